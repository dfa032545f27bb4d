"""Mixture of experts: one `FusedMoE` layer (routing + stacked experts) and the
`SparseMoeBlock` around it (router linear, optional shared experts) every MoE family uses.

Routing is data (`MoERouting`, built from a family's config fields), the kernels come from the
device's provider (`kernel_ops(device).moe_route` / `.fused_moe`), and the expert weights are
made by the layer's quant method and filled from per-expert checkpoint names through
`expert_params_mapping` (see `make_expert_params_mapping`).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Literal, Optional

import torch
from torch import nn

from atom_core.distributed import (all_reduce, combine_tokens, dispatch_tokens, expert_parallel_enabled,
                                   experts_span_replicas, get_ep_group, replica_token_counts)
from atom_core.kernel_config import build_kernel_config
from atom_core.kernels import kernel_ops
from atom_core.kernels.moe_ref import check_activation
from atom_core.model_ops.linear import ReplicatedLinear, copy_weight
from atom_core.quant import QuantConfig, UnquantizedFusedMoEMethod, set_weight_attrs
from atom_core.quant.base import MoELayer


@dataclass(frozen=True)
class MoERouting:
    """How a family picks and weighs its top-k experts (the HF router it reproduces).

    scoring: softmax over all experts (Mixtral, Qwen3-MoE) or per-expert sigmoid (GLM-4.5,
    DeepSeek-V3). renormalize: weights divided by their sum. correction_bias: the router holds
    `e_score_correction_bias`, added to the scores for choosing only. num_expert_group /
    topk_group: experts are chosen only from the best topk_group groups. router_in_fp32: the
    router matmul runs in float32 (HF GLM-4.5 does). weights_in_model_dtype: HF rounds the
    routing weights to the model dtype before weighing the experts (Qwen3-MoE does).
    """

    top_k: int
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    renormalize: bool = False
    correction_bias: bool = False
    num_expert_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    router_in_fp32: bool = False
    weights_in_model_dtype: bool = False


def make_expert_params_mapping(num_experts: int, gate: str, down: str, up: str,
                               experts: str = "experts") -> list[tuple[str, str, int | None, str | None]]:
    """Loader rules (param, checkpoint name, expert id, shard id) for per-expert checkpoints,
    e.g. gate/down/up = "gate_proj", "down_proj", "up_proj" or Mixtral's "w1", "w2", "w3", and
    for HF transformers' fused layout (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`)."""
    rules: list[tuple[str, str, int | None, str | None]] = []
    for e in range(num_experts):
        # weight_scale_inv: block-FP8 experts (quant/fp8.py); weight_packed/_scale/_shape: compressed-tensors
        # W4A16 experts (quant/int4_moe.py). A rule only applies where its target parameter exists.
        for suffix in ("weight", "weight_scale_inv", "weight_packed", "weight_scale", "weight_shape"):
            rules += [(f"{experts}.w13_{suffix}", f"{experts}.{e}.{gate}.{suffix}", e, "w1"),
                      (f"{experts}.w13_{suffix}", f"{experts}.{e}.{up}.{suffix}", e, "w3"),
                      (f"{experts}.w2_{suffix}", f"{experts}.{e}.{down}.{suffix}", e, "w2")]
    rules += [(f"{experts}.w13_weight", f"{experts}.gate_up_proj", None, None),
              (f"{experts}.w2_weight", f"{experts}.down_proj", None, None)]
    return rules


# Layers by key, as in model_ops/attention.py: under torch.compile the experts run as one
# opaque op (the kernels' host-side setup is not traceable), which looks its layer up here.
_LAYERS: "weakref.WeakValueDictionary[int, FusedMoE]" = weakref.WeakValueDictionary()


@torch.library.custom_op("atom::fused_moe_layer", mutates_args=())
def fused_moe_layer_op(hidden: torch.Tensor, router_logits: torch.Tensor, correction_bias: Optional[torch.Tensor],
                       layer_key: torch.Tensor) -> torch.Tensor:
    return _LAYERS[int(layer_key)].route_and_run(hidden, router_logits, correction_bias)


@fused_moe_layer_op.register_fake
def _(hidden, router_logits, correction_bias, layer_key):
    return torch.empty_like(hidden)


# Whole-tensor checkpoint layouts (expert_id None), named by the shard id of the loader rule.
WHOLE_LAYOUTS = {
    None: "[E, 2I, H] / [E, H, I] (biases [E, 2I] / [E, H])",
    "transposed": "[E, H, 2I] / [E, I, H], applied as x @ W (HF GptOssExperts.gate_up_proj / down_proj)",
}


class FusedMoE(MoELayer):
    """hidden [T, H], router_logits [T, E] -> sum over the top-k experts of weight * expert(hidden).

    Parameters (from the quant method): w13_weight [E, 2I, H] (gate rows, then up rows) and
    w2_weight [E, H, I]; with has_bias also w13_bias [E, 2I] and w2_bias [E, H].
    `weight_loader(param, tensor, shard_id, expert_id)` places one expert's w1 (gate) / w3 (up) /
    w2 (down); expert_id None loads a whole tensor of every expert in one of WHOLE_LAYOUTS.
    gate_up_interleaved: the checkpoint's whole w13 tensors alternate gate and up rows, gate first
    (GPT-OSS); the loader de-interleaves them into gate rows, then up rows.

    activation: "silu", or "swigluoai" (GPT-OSS: clamped at swiglu_limit, see moe_ref.apply_activation).
    Under tensor parallelism w2_bias lives on rank 0 only (zeros elsewhere): every rank's output
    is a partial sum of the down projection over its intermediate slice, and the all_reduce adds
    them, so a bias on every rank would be added tp times. Zeros rather than bias / tp: exact,
    whatever tp is.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, routing: MoERouting,
                 prefix: str = "", quant_config: QuantConfig | None = None, activation: str = "silu",
                 swiglu_limit: float | None = None, has_bias: bool = False, gate_up_interleaved: bool = False):
        super().__init__()
        if not 1 <= routing.top_k <= num_experts:
            raise ValueError(f"{prefix}: num_experts_per_tok={routing.top_k} must be in [1, {num_experts}]")
        try:
            check_activation(activation, swiglu_limit)
        except ValueError as exc:
            raise ValueError(f"{prefix}: {exc}") from exc
        self._split_over_ranks(num_experts, intermediate_size, prefix)
        self.routing, self.activation, self.swiglu_limit, self.prefix = routing, activation, swiglu_limit, prefix
        self.gate_up_interleaved = gate_up_interleaved
        method = quant_config.get_quant_method(self, prefix) if quant_config is not None else None
        self.quant_method = method or UnquantizedFusedMoEMethod()
        # The quant method makes this rank's part: its experts, each with its intermediate slice.
        self.quant_method.create_weights(self, num_experts=self.num_local_experts, hidden_size=hidden_size,
                                         intermediate_size=self.intermediate_size, weight_loader=self.weight_loader,
                                         has_bias=has_bias)
        experts = range(self.expert_start, self.expert_start + self.num_local_experts)
        for name in ("w13_weight", "w13_bias"):
            if hasattr(self, name):
                getattr(self, name).expected_shards = frozenset((s, e) for e in experts for s in ("w1", "w3"))
        for name in ("w2_weight", "w2_bias"):
            if hasattr(self, name):
                getattr(self, name).expected_shards = frozenset(("w2", e) for e in experts)
        self.ops = kernel_ops(torch.get_default_device())
        self.model_dtype = torch.get_default_dtype()
        self.layer_key = torch.tensor([id(self)], dtype=torch.int64, device="cpu")
        _LAYERS[id(self)] = self

    def _split_over_ranks(self, num_experts: int, intermediate_size: int, prefix: str) -> None:
        """Tensor parallel: every expert, a 1/tp slice of its intermediate dim. Expert parallel
        (enable_expert_parallel): num_experts/tp whole experts, [expert_start, + num_local_experts)."""
        group = self.ep_group = get_ep_group()
        self.num_experts, self.tp_size, self.tp_rank = num_experts, group.world_size, group.rank_in_group
        self.use_ep = self.tp_size > 1 and expert_parallel_enabled()
        self.spans_replicas = self.use_ep and experts_span_replicas()  # tokens differ by rank: dispatch them
        self.all_to_all = self.spans_replicas and build_kernel_config().ep_dispatch == "alltoall"
        self.num_local_experts, self.expert_start, self.intermediate_size = num_experts, 0, intermediate_size
        if self.use_ep:
            if num_experts % self.tp_size:
                raise ValueError(f"{prefix}: {num_experts} experts do not split over {self.tp_size} expert-parallel "
                                 "ranks; use a tensor_parallel_size that divides them, or drop enable_expert_parallel")
            self.num_local_experts = num_experts // self.tp_size
            self.expert_start = self.tp_rank * self.num_local_experts
        elif intermediate_size % self.tp_size:
            raise ValueError(f"{prefix}: moe intermediate size {intermediate_size} does not split over "
                             f"{self.tp_size} tensor-parallel ranks")
        else:
            self.intermediate_size = intermediate_size // self.tp_size

    def _tp_slice(self, dst: torch.Tensor, loaded: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of `loaded` along `dim` when the checkpoint holds all tp slices."""
        if self.use_ep or self.tp_size == 1 or loaded.dim() == 0 or loaded.dim() != dst.dim():
            return loaded
        size = dst.shape[dim]
        if loaded.shape[dim] != size * self.tp_size:
            return loaded
        return loaded.narrow(dim, self.tp_rank * size, size)

    def _is_w13(self, param: nn.Parameter) -> bool:
        """w13_* parameters (weight, bias, a quant method's scales) hold gate rows, then up rows, in dim 1."""
        return any(p is param for name, p in self.named_parameters(recurse=False) if name.startswith("w13"))

    def _off_rank_zero_w2_bias(self, param: nn.Parameter) -> bool:
        return param is getattr(self, "w2_bias", None) and self.tp_size > 1 and not self.use_ep and self.tp_rank != 0

    def _to_stacked(self, param: nn.Parameter, loaded: torch.Tensor, layout: str | None) -> torch.Tensor:
        """A whole checkpoint tensor in `layout` (WHOLE_LAYOUTS) -> ours, all experts, every TP slice."""
        if layout not in WHOLE_LAYOUTS:
            raise ValueError(f"{self.prefix}: unknown expert tensor layout {layout!r}; expected one of: "
                             f"{', '.join(map(str, WHOLE_LAYOUTS))}")
        transposed = layout == "transposed"
        if loaded.dim() < 2 or loaded.shape[0] != self.num_experts or (transposed and loaded.dim() != 3):
            raise ValueError(f"{self.prefix}: a checkpoint tensor of shape {tuple(loaded.shape)} is not "
                             f"{self.num_experts} experts in the layout {WHOLE_LAYOUTS[layout]}")
        if transposed:
            loaded = loaded.transpose(1, 2)
        if self.gate_up_interleaved and self._is_w13(param):
            if loaded.shape[1] % 2:
                raise ValueError(f"{self.prefix}: interleaved gate/up rows need an even count, got "
                                 f"{tuple(loaded.shape)}")
            loaded = torch.cat([loaded[:, 0::2], loaded[:, 1::2]], dim=1)
        return loaded

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None,
                      expert_id: int | None = None) -> None:
        if self._off_rank_zero_w2_bias(param):
            loaded = torch.zeros_like(loaded)  # added once over the all_reduce: see the class docstring
        if expert_id is None:  # every expert at once
            shape = tuple(loaded.shape)
            loaded = self._to_stacked(param, loaded, shard_id)
            if self.use_ep:
                loaded = loaded.narrow(0, self.expert_start, self.num_local_experts)
            elif self.tp_size > 1 and self._is_w13(param):
                gate, up = loaded.chunk(2, dim=1)
                half = param.data.shape[1] // 2
                loaded = torch.cat([self._tp_slice(param.data[:, :half], gate, 1),
                                    self._tp_slice(param.data[:, half:], up, 1)], dim=1)
            elif self.tp_size > 1:
                loaded = self._tp_slice(param.data, loaded, loaded.dim() - 1)
            try:
                copy_weight(param.data, loaded)
            except ValueError as exc:
                raise ValueError(f"{self.prefix}: checkpoint tensor of shape {shape} in the layout "
                                 f"{WHOLE_LAYOUTS[shard_id]}: {exc}") from exc
            return
        local = expert_id - self.expert_start
        if not 0 <= local < self.num_local_experts:
            return  # another rank's expert
        size = self.intermediate_size
        if shard_id == "w1":
            dst = param.data[local, :size]
            loaded = self._tp_slice(dst, loaded, 0)
        elif shard_id == "w3":
            dst = param.data[local, size:]
            loaded = self._tp_slice(dst, loaded, 0)
        elif shard_id == "w2":
            dst = param.data[local]
            loaded = self._tp_slice(dst, loaded, dst.dim() - 1)
        else:
            raise ValueError(f"{self.prefix}: unknown expert shard {shard_id!r}; expected one of: w1, w2, w3")
        copy_weight(dst, loaded)

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor,
                correction_bias: torch.Tensor | None = None) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return fused_moe_layer_op(hidden, router_logits, correction_bias, self.layer_key)
        return self.route_and_run(hidden, router_logits, correction_bias)

    def route_and_run(self, hidden: torch.Tensor, router_logits: torch.Tensor,
                      correction_bias: torch.Tensor | None) -> torch.Tensor:
        if self.all_to_all:  # tokens go to their experts' owners only
            from atom_core.distributed.moe_all_to_all import moe_all_to_all

            weights, ids = self._route(router_logits, correction_bias)
            run = lambda h, w, i: self.quant_method.apply(self, h, w, i, activation=self.activation,  # noqa: E731
                                                          swiglu_limit=self.swiglu_limit)
            return moe_all_to_all(hidden, weights, ids, self.num_local_experts, self.ep_group, run)
        if self.spans_replicas:  # DP attention + EP: every replica's tokens meet this rank's experts
            counts = replica_token_counts(hidden.shape[0], self.ep_group)
            hidden = dispatch_tokens(hidden, counts, self.ep_group)
            router_logits = dispatch_tokens(router_logits, counts, self.ep_group)
        weights, ids = self._route(router_logits, correction_bias)
        if self.use_ep:  # other ranks' experts weigh 0 here (static shapes: CUDA-graph safe)
            local = ids - self.expert_start
            owned = (local >= 0) & (local < self.num_local_experts)
            weights = weights * owned
            ids = torch.where(owned, local, 0).to(ids.dtype)
        out = self.quant_method.apply(self, hidden, weights, ids, activation=self.activation,
                                      swiglu_limit=self.swiglu_limit)
        if self.spans_replicas:
            return combine_tokens(out, counts, self.ep_group)  # the sum over ranks, this replica's rows
        return all_reduce(out) if self.tp_size > 1 else out  # partial sums: a slice of each expert, or some experts


    def _route(self, router_logits: torch.Tensor, correction_bias: torch.Tensor | None):
        """Top-k weights (float32) and global expert ids per token."""
        r = self.routing
        weights, ids = self.ops.moe_route(router_logits, r.top_k, scoring=r.scoring, renormalize=r.renormalize,
                                          correction_bias=correction_bias, num_expert_group=r.num_expert_group,
                                          topk_group=r.topk_group, routed_scaling_factor=r.routed_scaling_factor)
        if r.weights_in_model_dtype:
            weights = weights.to(self.model_dtype).float()
        return weights, ids


class SparseMoeBlock(nn.Module):
    """HF's MoE MLP: `gate` (the router linear, with `e_score_correction_bias` when routing uses
    one), `experts` (FusedMoE), and `shared_experts` added to the routed output when given."""

    def __init__(self, hidden_size: int, num_experts: int, intermediate_size: int, routing: MoERouting,
                 prefix: str, quant_config: QuantConfig | None = None, shared_experts: nn.Module | None = None):
        super().__init__()
        # Routers stay unquantized in every format we know (their logits pick the experts).
        self.gate = ReplicatedLinear(hidden_size, num_experts, prefix=f"{prefix}.gate",
                                     params_dtype=torch.float32 if routing.router_in_fp32 else None)
        if routing.correction_bias:  # float32 in HF too (_keep_in_fp32_modules_strict)
            bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32), requires_grad=False)
            set_weight_attrs(bias, weight_loader=self.gate.weight_loader)
            self.gate.e_score_correction_bias = bias
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, routing, f"{prefix}.experts",
                                quant_config)
        self.shared_experts = shared_experts
        self.router_in_fp32 = routing.router_in_fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x.float() if self.router_in_fp32 else x)
        out = self.experts(x, logits, getattr(self.gate, "e_score_correction_bias", None))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
