"""Paged attention layer: from the fused QKV projection's output to attention output, with
q/k-norm, RoPE and the KV store done by the layer's backend first (model_ops/attention_backends)."""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from atom_core.distributed import get_tp_group
from atom_core.kernel_config import build_kernel_config
from atom_core.model_ops.attention_backends import AttentionBackend, get_attention_backend
from atom_core.model_ops.kv_spec import KVSpec
from atom_core.model_ops.layernorm import RMSNorm
from atom_core.model_ops.linear import copy_weight
from atom_core.model_ops.rotary import RotaryEmbedding


@dataclass(frozen=True, eq=False)
class QKTransform:
    """What runs on q and k between the projection and the cache: per-head RMSNorm (both or
    neither), then neox RoPE over the first `rotary.rotary_dim` dims of each head.

    A plain object, not a module: the norms and the rotary cache stay registered where the
    checkpoint names them (e.g. `self_attn.q_norm.weight`); the backend reads them through this.
    """

    rotary: RotaryEmbedding
    q_norm: RMSNorm | None = None
    k_norm: RMSNorm | None = None

    def __post_init__(self):
        if (self.q_norm is None) != (self.k_norm is None):
            raise ValueError("q_norm and k_norm go together")


def _attend(layer: "Attention", qkv: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """positions [T] index the rotary's cache; [3, T] (a multimodal rotary's image rows, MRotaryEmbedding)
    become a per-row cos/sin table the rows index in order."""
    if positions.dim() == 2:
        cos_sin = layer.qk.rotary.cos_sin_rows(positions)
        rows = torch.arange(positions.shape[1], device=positions.device)
        return layer.backend(qkv.device).forward(layer, qkv, rows, cos_sin=cos_sin)
    return layer.backend(qkv.device).forward(layer, qkv, positions)


# Layers by key, so the compiled graph passes a key, not the cache tensors: cache tensors as
# op arguments would be "mutated inputs" to functionalize, i.e. copied back after every call.
# The key is a 1-element CPU tensor, not an int: Dynamo would bake an int into each layer's
# graph and recompile per layer; a tensor is a graph input, so all layers share one graph.
_LAYERS: "weakref.WeakValueDictionary[int, Attention]" = weakref.WeakValueDictionary()


@torch.library.custom_op("atom::paged_attention", mutates_args=())
def paged_attention_op(qkv: torch.Tensor, positions: torch.Tensor, layer_key: torch.Tensor,
                       q_width: int) -> torch.Tensor:
    """Opaque to torch.compile: the graph splits here. The KV store inside is a side effect on
    the layer's cache, which the compiler never sees (metadata comes from the forward context;
    norms and the rotary cache come from the layer). The kernels take any row stride, so only
    a non-unit last-dim stride needs a copy.
    """
    layer = _LAYERS[int(layer_key)]  # a CPU tensor: no device sync
    qkv = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    return _attend(layer, qkv, positions)


@paged_attention_op.register_fake
def _(qkv, positions, layer_key, q_width):
    return qkv.new_empty(qkv.shape[0], q_width)


class Attention(nn.Module):
    """qkv [T, (H + 2*KH) * D] -> out [T, H*D] for the flat batch in the forward context.

    Declares `kv_spec` (what a token costs in the cache, its window) at construction, in the
    default dtype the model is built under. The worker assigns `k_cache`/`v_cache` views
    (kv_spec.allocate_kv_cache) before the first forward. `use_custom_op` (set when
    compiling) routes through the opaque op.

    sinks=True (GPT-OSS) adds the parameter `sinks` [num_heads] (this rank's heads): a learned
    logit per head that joins the softmax denominator and carries no value. Float32 whatever the
    model dtype: the kernels' softmax runs in float32, and a bf16 checkpoint loads into it exactly
    (HF holds it in the model dtype). Its loader takes this rank's slice of the checkpoint's heads.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, qk: QKTransform,
                 sliding_window: int | None = None, prefix: str = "", sinks: bool = False):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.qk = qk
        self.prefix = prefix
        self.dtype = torch.get_default_dtype()  # the compute (query) dtype
        self.kv_spec = KVSpec("mha", num_kv_heads, head_dim, self.dtype, sliding_window, has_sinks=sinks)
        if sinks:
            self.sinks = nn.Parameter(torch.empty(num_heads, dtype=torch.float32), requires_grad=False)
            self.sinks.weight_loader = self._load_sinks
        else:
            self.sinks = None
        self.k_cache = self.v_cache = torch.empty(0)
        # An FP8 cache (--kv-cache-dtype fp8) stores K / k_scale and V / v_scale: the checkpoint's
        # calibrated per-layer scales (`self_attn.k_scale` / `v_scale`, e.g. llm-compressor's
        # kv_cache_scheme) when it has them, else 1.0 (bf16 K/V of real models sit far inside
        # e4m3's +-448), as in vLLM. Optional parameters: absent from most checkpoints; the kernels
        # read the floats in `kv_scales`, taken once after loading (finalize_kv_scales).
        for name in ("k_scale", "v_scale"):
            scale = nn.Parameter(torch.ones(1, dtype=torch.float32), requires_grad=False)
            scale.optional_in_checkpoint = True
            self.register_parameter(name, scale)
        self.kv_scales = (1.0, 1.0)
        self.use_custom_op = False
        self._backend: AttentionBackend | None = None
        self.kernel_config = build_kernel_config()  # the backend's kernel choices (KernelConfig)
        self.layer_key = torch.tensor([id(self)], dtype=torch.int64, device="cpu")
        _LAYERS[id(self)] = self

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """[total heads] -> this rank's heads (query heads split evenly over the TP ranks)."""
        group = get_tp_group()
        if loaded.shape != (self.num_heads * group.world_size,):
            raise ValueError(f"{self.prefix}: sinks of shape {tuple(loaded.shape)}; expected "
                             f"[{self.num_heads * group.world_size}] (one per attention head)")
        copy_weight(param.data, loaded.narrow(0, group.rank_in_group * self.num_heads, self.num_heads))

    def backend(self, device: torch.device) -> AttentionBackend:
        if self._backend is None:
            self._backend = get_attention_backend(self.kv_spec.kind, device, self.kernel_config)
        return self._backend

    def forward(self, qkv: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.use_custom_op:
            return paged_attention_op(qkv, positions, self.layer_key, self.num_heads * self.head_dim)
        assert self.k_cache.numel() or not self.backend(qkv.device).needs_allocated_cache, \
            "KV cache not allocated for this attention layer"
        return _attend(self, qkv, positions)
