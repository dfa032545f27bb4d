"""Paged attention layer: stores this step's K/V, then attends over the block-table cache."""
from __future__ import annotations

import torch
from torch import nn

from atom_core.kernels import kernel_ops
from atom_core.model_ops.forward_context import get_attention_metadata


class Attention(nn.Module):
    """q [T, H*D], k/v [T, KH*D] -> out [T, H*D] for the flat batch in the forward context.

    The runner assigns `k_cache`/`v_cache` ([NB, BS, KH, D] views of one big cache tensor)
    before the first forward. Without a cache (profiling a bare module) it raises.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.k_cache = self.v_cache = torch.empty(0)
        self.ops = kernel_ops(torch.get_default_device())

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = get_attention_metadata()
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        assert self.k_cache.numel(), "KV cache not allocated for this attention layer"
        self.ops.store_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = self.ops.paged_attention(
            q, self.k_cache, self.v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
            self.scale, meta.max_query_len, meta.max_seq_len,
        )
        return out.view(-1, self.num_heads * self.head_dim)
