"""Paged attention layer: from the fused QKV projection's output to attention output, with
q/k-norm, RoPE and the KV store done in one kernel first."""
from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch import nn

from atom_core.kernels import kernel_ops
from atom_core.model_ops.forward_context import get_attention_metadata


def _prepare_and_attend(qkv, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps,
                        layer: "Attention") -> torch.Tensor:
    meta = get_attention_metadata()
    ops = kernel_ops(qkv.device)
    q = ops.qkv_rope_store(qkv, positions, cos_sin_cache, layer.k_cache, layer.v_cache, meta.slot_mapping,
                           layer.num_heads, q_norm_weight, k_norm_weight, eps)
    out = ops.paged_attention(q, layer.k_cache, layer.v_cache, meta.block_tables, meta.query_start_loc,
                              meta.seq_lens, layer.scale, meta.max_query_len, meta.max_seq_len,
                              seq_order=meta.seq_order)
    return out.view(-1, layer.num_heads * layer.head_dim)


# Layers by key, so the compiled graph passes a key, not the cache tensors: cache tensors as
# op arguments would be "mutated inputs" to functionalize, i.e. copied back after every call.
# The key is a 1-element CPU tensor, not an int: Dynamo would bake an int into each layer's
# graph and recompile per layer; a tensor is a graph input, so all layers share one graph.
_LAYERS: "weakref.WeakValueDictionary[int, Attention]" = weakref.WeakValueDictionary()


@torch.library.custom_op("atom::paged_attention", mutates_args=())
def paged_attention_op(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                       q_norm_weight: Optional[torch.Tensor], k_norm_weight: Optional[torch.Tensor],
                       eps: float, layer_key: torch.Tensor, q_width: int) -> torch.Tensor:
    """Opaque to torch.compile: the graph splits here. The KV store inside is a side effect on
    the layer's cache, which the compiler never sees (metadata comes from the forward context).
    The kernels take any row stride, so only a non-unit last-dim stride needs a copy.
    """
    layer = _LAYERS[int(layer_key)]  # a CPU tensor: no device sync
    qkv = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    return _prepare_and_attend(qkv, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps, layer)


@paged_attention_op.register_fake
def _(qkv, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps, layer_key, q_width):
    return qkv.new_empty(qkv.shape[0], q_width)


class Attention(nn.Module):
    """qkv [T, (H + 2*KH) * D] -> out [T, H*D] for the flat batch in the forward context.

    The runner assigns `k_cache`/`v_cache` ([NB, BS, KH, D] views of one big cache tensor)
    before the first forward. `use_custom_op` (set when compiling) routes through the opaque op.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.k_cache = self.v_cache = torch.empty(0)
        self.use_custom_op = False
        self.layer_key = torch.tensor([id(self)], dtype=torch.int64, device="cpu")
        _LAYERS[id(self)] = self

    def forward(self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                eps: float = 1e-6) -> torch.Tensor:
        if self.use_custom_op:
            return paged_attention_op(qkv, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps,
                                      self.layer_key, self.num_heads * self.head_dim)
        assert self.k_cache.numel(), "KV cache not allocated for this attention layer"
        return _prepare_and_attend(qkv, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps, self)
