"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5): a short causal convolution, then the gated
delta rule over a fixed-size recurrent state per sequence, then a gated RMSNorm and out_proj.

A layer keeps no per-token KV: it declares a `StateSpec` (model_ops/kv_spec.py) and the worker gives it
`recurrent_state` / `conv_state` pools; the forward context's `state_slots` say which row is each
sequence's. A sequence with no cached context (its prompt's first chunk) starts from zeros; every step
writes each sequence's final state back, so a prompt split over steps carries its state from chunk to
chunk. The kernels (the gated delta rule, the causal conv1d, the gated norm) come from the provider.
That core, the part that reads the step's metadata and the pools, is `DeltaNetCore`: under torch.compile
it runs as the opaque op `atom::gated_delta_net` (the projections around it compile), and piecewise
graphs split at it as at attention.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from atom_core.distributed import get_tp_group
from atom_core.kernels import kernel_ops
from atom_core.model_ops.forward_context import get_attention_metadata
from atom_core.model_ops.kv_spec import StateSpec
from atom_core.model_ops.linear import MergedColumnParallelLinear, RowParallelLinear, copy_weight
from atom_core.quant import QuantConfig


def _rank_part(loaded: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    return loaded.narrow(0, rank * size, size)


class ConcatColumnParallelLinear(MergedColumnParallelLinear):
    """Column-parallel outputs that a checkpoint stores as ONE tensor (Qwen3.5's in_proj_qkv, q | k | v):
    a whole tensor is cut into its parts by their sizes and each rank takes its slice of every part."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        dim = getattr(param, "output_dim", None)
        if shard_id is not None or dim is None or self.tp_size == 1:
            return super().weight_loader(param, loaded, shard_id)
        total, start = sum(self.output_sizes), 0
        for i, size in enumerate(self.output_sizes):  # rows scale alike for weights and block scales
            rows = loaded.shape[dim] * size // total
            super().weight_loader(param, loaded.narrow(dim, start, rows), i)
            start += rows


class GatedDeltaNet(nn.Module):
    """hidden [T, H] -> [T, H] for the flat batch in the forward context.

    A family subclasses it with its input projections and `project(hidden) -> (mixed_qkv [T, C] before
    the conv, channels q | k | v; z [T, Hv, Dv]; b, a [T, Hv])`. Parameters here, under the checkpoint
    names HF uses: conv1d.weight [C, 1, K], A_log and dt_bias [Hv], norm.weight [Dv], out_proj.
    Tensor parallel: key and value heads split over the ranks (the conv channels part by part).
    """

    def __init__(self, config, prefix: str, quant_config: QuantConfig | None = None):
        super().__init__()
        group = get_tp_group()
        tp, rank = group.world_size, group.rank_in_group
        if config.linear_num_key_heads % tp or config.linear_num_value_heads % config.linear_num_key_heads:
            raise ValueError(f"{prefix}: {config.linear_num_key_heads} key heads and {config.linear_num_value_heads} "
                             f"value heads do not split over {tp} tensor-parallel ranks (value heads must be a "
                             "multiple of key heads, key heads of the ranks)")
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} for gated DeltaNet; expected silu")
        self.prefix = prefix
        self.tp_rank = rank
        self.num_k_heads = config.linear_num_key_heads // tp
        self.num_v_heads = config.linear_num_value_heads // tp
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_kernel = config.linear_conv_kernel_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.eps = config.rms_norm_eps
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, self.conv_kernel), requires_grad=False)
        self.conv1d.weight.weight_loader = self._load_conv
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        for p in (self.A_log, self.dt_bias):
            p.weight_loader = self._load_per_head
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.head_v_dim), requires_grad=False)
        self.out_proj = RowParallelLinear(config.linear_num_value_heads * self.head_v_dim, config.hidden_size,
                                          quant_config=quant_config, prefix=f"{prefix}.out_proj")
        dtype = torch.get_default_dtype()
        self.state_spec = StateSpec(self.num_v_heads, self.head_k_dim, self.head_v_dim, self.conv_dim,
                                    self.conv_kernel, conv_dtype=dtype)
        self.recurrent_state = self.conv_state = torch.empty(0)
        self.step_recurrent_state = self.step_conv_state = None  # verify steps' per-token states (kv_spec.py)
        self.ops = kernel_ops(self.A_log.device)
        self.use_custom_op = False  # set when compiling: the core runs as atom::gated_delta_net
        self._backend: DeltaNetCore | None = None
        self.layer_key = torch.tensor([id(self)], dtype=torch.int64, device="cpu")
        _LAYERS[id(self)] = self

    def _load_conv(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """[C_total, 1, K] with channels q | k | v -> this rank's part of each."""
        tp = loaded.shape[0] // self.conv_dim
        key, value = self.key_dim, self.value_dim
        parts = loaded.split([key * tp, key * tp, value * tp])
        copy_weight(param.data, torch.cat([_rank_part(p, n, self.tp_rank)
                                           for p, n in zip(parts, (key, key, value))]))

    def _load_per_head(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        copy_weight(param.data, _rank_part(loaded, self.num_v_heads, self.tp_rank))

    def project(self, hidden: torch.Tensor):
        raise NotImplementedError

    def backend(self, device: torch.device) -> "DeltaNetCore":
        """What reads the step's metadata and the state pools (piecewise graphs swap it during a capture)."""
        if self._backend is None:
            self._backend = _CORE
        return self._backend

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        mixed_qkv, z, b, a = self.project(hidden)
        if self.use_custom_op:
            o = gated_delta_net_op(mixed_qkv, z, b, a, self.layer_key)
        else:
            o = self.backend(hidden.device).forward(self, mixed_qkv, z, b, a)
        return self.out_proj(o)


class DeltaNetCore:
    """The part of a GatedDeltaNet that reads the step (the forward context's metadata) and its state
    pools: the causal conv1d, the gated delta rule, the gated RMSNorm. Stateless: the layer carries
    the parameters, pools and kernels; token-major inputs and output, so piecewise graphs split here
    as at attention (worker/piecewise.py)."""

    def forward(self, layer: GatedDeltaNet, mixed_qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor,
                a: torch.Tensor) -> torch.Tensor:
        """mixed_qkv [T, C], z [T, Hv, Dv], b and a [T, Hv] -> [T, Hv * Dv]."""
        assert layer.recurrent_state.numel(), f"{layer.prefix}: state pools not allocated"
        meta = get_attention_metadata()
        cu_seqlens, slots = meta.query_start_loc, meta.state_slots
        has_initial_state = meta.seq_lens > (cu_seqlens[1:] - cu_seqlens[:-1])  # cached context before this step
        ops = layer.ops
        # A step that verifies drafts keeps the state after each token (rejected drafts roll back).
        steps = {} if meta.state_step_rows is None else {"step_indices": meta.state_step_rows}
        x = ops.causal_conv1d(mixed_qkv, layer.conv1d.weight.squeeze(1), None, layer.conv_state, slots, cu_seqlens,
                              has_initial_state, activation="silu",
                              **(steps and {**steps, "step_state": layer.step_conv_state}))
        q, k, v = x.split([layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
        num_tokens = x.shape[0]
        q = q.reshape(num_tokens, layer.num_k_heads, layer.head_k_dim)
        k = k.reshape(num_tokens, layer.num_k_heads, layer.head_k_dim)
        v = v.reshape(num_tokens, layer.num_v_heads, layer.head_v_dim)
        beta = b.sigmoid()
        g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)  # HF's log-decay, float32
        rule_args = dict(scale=layer.head_k_dim ** -0.5, use_qk_l2norm=True)
        if steps and meta.state_chunked_seqs is not None:
            o = self._split_step(layer, meta, (q, k, v, g, beta), has_initial_state, rule_args)
        elif meta.max_query_len == 1 or steps:
            # One token per sequence (decode) or a verify step: the recurrent step, which can keep
            # the state after each token.
            o = ops.fused_recurrent_gated_delta_rule(
                q, k, v, g, beta, layer.recurrent_state, slots, cu_seqlens, has_initial_state, **rule_args,
                **(steps and {**steps, "step_state": layer.step_recurrent_state}))
        else:
            o = ops.chunk_gated_delta_rule(q, k, v, g, beta, layer.recurrent_state, slots, cu_seqlens,
                                           has_initial_state, **rule_args)
        o = ops.gated_rms_norm(o.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim), layer.norm.weight,
                               layer.eps)
        return o.reshape(num_tokens, layer.value_dim)

    @staticmethod
    def _split_step(layer: GatedDeltaNet, meta, qkvgb: tuple, has_initial_state: torch.Tensor,
                    rule_args: dict) -> torch.Tensor:
        """A verify step that also runs prompt chunks: the verifying sequences (and decodes) through
        the token-by-token rule keeping their per-token states, the prompt chunks through the
        chunked rule (token by token, a long chunk would take as many dependent steps as tokens)."""

        def subset(name: str):
            seqs, tokens = getattr(meta, f"state_{name}_seqs"), getattr(meta, f"state_{name}_tokens")
            return seqs, tokens, (*(t.index_select(0, tokens) for t in qkvgb), layer.recurrent_state,
                                  meta.state_slots.index_select(0, seqs), getattr(meta, f"state_{name}_cu_seqlens"),
                                  has_initial_state.index_select(0, seqs))

        o = torch.empty_like(qkvgb[2])
        seqs, tokens, args = subset("recurrent")
        o[tokens] = layer.ops.fused_recurrent_gated_delta_rule(
            *args, **rule_args, step_state=layer.step_recurrent_state,
            step_indices=meta.state_step_rows.index_select(0, seqs))
        _, tokens, args = subset("chunked")
        o[tokens] = layer.ops.chunk_gated_delta_rule(*args, **rule_args)
        return o


_CORE = DeltaNetCore()

# Layers by key, as attention's (model_ops/attention.py says why a CPU tensor and not the pools).
_LAYERS: "weakref.WeakValueDictionary[int, GatedDeltaNet]" = weakref.WeakValueDictionary()


@torch.library.custom_op("atom::gated_delta_net", mutates_args=())
def gated_delta_net_op(mixed_qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                       layer_key: torch.Tensor) -> torch.Tensor:
    """Opaque to torch.compile, as atom::paged_attention: the graph splits here; the state updates
    inside are side effects on the layer's pools, which the compiler never sees."""
    layer = _LAYERS[int(layer_key)]
    return layer.backend(mixed_qkv.device).forward(layer, mixed_qkv, z, b, a)


@gated_delta_net_op.register_fake
def _(mixed_qkv, z, b, a, layer_key):
    return mixed_qkv.new_empty(z.shape[0], z.shape[1] * z.shape[2])  # o is in v's dtype, the conv input's
