"""Paged attention layer: stores this step's K/V, then attends over the block-table cache."""
from __future__ import annotations

import weakref

import torch
from torch import nn

from atom_core.kernels import kernel_ops
from atom_core.model_ops.forward_context import get_attention_metadata


def _store_and_attend(q, k, v, k_cache, v_cache, scale: float) -> torch.Tensor:
    meta = get_attention_metadata()
    ops = kernel_ops(q.device)
    ops.store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    return ops.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                               scale, meta.max_query_len, meta.max_seq_len)


# Layers by key, so the compiled graph passes a key, not the cache tensors: cache tensors as
# op arguments would be "mutated inputs" to functionalize, i.e. copied back after every call.
# The key is a 1-element CPU tensor, not an int: Dynamo would bake an int into each layer's
# graph and recompile per layer; a tensor is a graph input, so all layers share one graph.
_LAYERS: "weakref.WeakValueDictionary[int, Attention]" = weakref.WeakValueDictionary()


@torch.library.custom_op("atom::paged_attention", mutates_args=())
def paged_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_key: torch.Tensor) -> torch.Tensor:
    """Opaque to torch.compile: the graph splits here. The KV store inside is a side effect on
    the layer's cache, which the compiler never sees (metadata comes from the forward context).
    Inductor may hand the op strided views (slices of the fused QKV output): the kernels take
    any row stride, so only a non-unit last-dim stride needs a copy (one kernel per layer saved).
    """
    layer = _LAYERS[int(layer_key)]  # a CPU tensor: no device sync
    return _store_and_attend(_rows(q), _rows(k), _rows(v), layer.k_cache, layer.v_cache, layer.scale)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@paged_attention_op.register_fake
def _(q, k, v, layer_key):
    return torch.empty_like(q)


class Attention(nn.Module):
    """q [T, H, D], k/v [T, KH, D] -> out [T, H*D] for the flat batch in the forward context.

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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.use_custom_op:
            out = paged_attention_op(q, k, v, self.layer_key)
        else:
            assert self.k_cache.numel(), "KV cache not allocated for this attention layer"
            out = _store_and_attend(q, k, v, self.k_cache, self.v_cache, self.scale)
        return out.reshape(-1, self.num_heads * self.head_dim)
