"""How the KV cache vLLM allocates for one attention layer becomes the views our kernels read
(K and V [num_blocks, block_size, kv_heads, head_size]; MLA: the latent [num_blocks, block_size, 1,
C + R] as both), for each layout a supported vLLM uses. Plain tensor functions, no vLLM import:
compat.py picks the running vLLM's layout once, and tests check both without vLLM.

- PLANES (vLLM 0.20): the runner shapes each layer's cache by the backend's `get_kv_cache_shape`
  (`kv_cache_shape` here): [2, NB, BS, KH, D] for MHA, K and V planes as FlashAttention's cache on
  CUDA has them, and [NB, BS, 1, C + R] for MLA.
- LOGICAL_PAGES (vLLM 0.32): every layer gets a logical [B, H, N, C] view (blocks, KV heads, tokens,
  then K and V of one head and token side by side; MLA: the latent row alone), laid out physically
  in whichever KVCacheLayout the backends allow; K and V are strided slices of it, which our
  kernels take (they read the block, slot and head strides).
"""
from __future__ import annotations

import torch

PLANES = "planes"
LOGICAL_PAGES = "logical_pages"
LAYOUTS = (PLANES, LOGICAL_PAGES)


def layout_of(kv_cache_interface) -> str:
    """The layout of the vLLM whose `vllm.v1.kv_cache_interface` module this is: 0.32 sizes each
    layer's logical pages with `compute_layer_kv_cache_shape_bytes` (RFC #42082), 0.20 has none."""
    return LOGICAL_PAGES if hasattr(kv_cache_interface, "compute_layer_kv_cache_shape_bytes") else PLANES


def kv_cache_shape(kind: str, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
    """The PLANES shape of one layer's cache (what our backends answer to `get_kv_cache_shape`)."""
    if kind == "mla":
        if num_kv_heads != 1:
            raise ValueError(f"an MLA cache holds one latent row per token, not {num_kv_heads} KV heads")
        return (num_blocks, block_size, 1, head_size)
    return (2, num_blocks, block_size, num_kv_heads, head_size)


def attention_views(cache: torch.Tensor, kind: str, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) views [NB, BS, KH, D] of the cache vLLM bound to one layer, sharing its memory (MLA:
    the latent cache [NB, BS, 1, C + R] twice, as our engine gives it)."""
    if layout == PLANES:
        expected = 4 if kind == "mla" else 5
        if cache.dim() != expected or (kind != "mla" and cache.shape[0] != 2):
            raise ValueError(f"vLLM bound a {kind} cache of shape {tuple(cache.shape)}; the {layout} layout has "
                             f"{'[NB, BS, 1, C + R]' if kind == 'mla' else '[2, NB, BS, KH, D]'}")
        return (cache, cache) if kind == "mla" else (cache[0], cache[1])
    if layout != LOGICAL_PAGES:
        raise ValueError(f"unknown KV cache layout {layout!r}; known: {', '.join(LAYOUTS)}")
    if cache.dim() != 4:
        raise ValueError(f"vLLM bound a {kind} cache of shape {tuple(cache.shape)}; the {layout} layout has "
                         f"[blocks, KV heads, tokens, C]")
    pages = cache.transpose(1, 2)  # [B, H, N, C] -> [B, N, H, C]
    if kind == "mla":
        return pages, pages
    head_size = pages.shape[-1] // 2
    return pages[..., :head_size], pages[..., head_size:]
