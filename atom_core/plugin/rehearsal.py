"""An eager run of our attention on the metadata of a CUDA graph vLLM is about to capture (no vLLM import:
tested on the CPU).

Why: Triton compiles a kernel variant at its first launch, and a compile inside a stream capture fails
the capture. vLLM runs the model eagerly before each capture, but on metadata of its own (the dummy
batch's max_seq_len), while the capture's metadata carries max_model_len (our builder's
build_for_cudagraph_capture), which picks other variants (split-KV, its merge); our engine warms up on
its capture's own metadata for the same reason (worker/cuda_graph.py). So plugin/attention.py's builder
calls this with the capture's metadata, outside the graph, just before vLLM captures it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from atom_core.model_ops.forward_context import AttentionMetadata, set_attention_metadata


def rehearsal_inputs(layer, rows: int) -> tuple[torch.Tensor, ...]:
    """Zero inputs of `rows` tokens in the layer's own shapes: (qkv, positions) for paged attention,
    (q, kv_a, positions) for MLA."""
    device = layer.k_cache.device
    positions = torch.zeros(rows, dtype=torch.int64, device=device)
    if layer.kv_spec.kind == "mla":
        q = torch.zeros(rows, layer.num_heads, layer.qk_nope_head_dim + layer.qk_rope_head_dim, dtype=layer.dtype,
                        device=device)
        return q, torch.zeros(rows, layer.kv_spec.head_size, dtype=layer.dtype, device=device), positions
    width = (layer.num_heads + 2 * layer.num_kv_heads) * layer.head_dim
    return torch.zeros(rows, width, dtype=layer.dtype, device=device), positions


@torch.inference_mode()
def rehearse_attention(layers: list, metadata: AttentionMetadata, backend_of: Callable) -> int:
    """Run one layer of each distinct KV spec in `layers` through `backend_of(layer)` on `metadata`'s
    batch, storing nothing (every slot -1); returns how many ran. Layers with a sparse-attention
    indexer (DeepSeek-V3.2) take more inputs and are left to vLLM's own eager run."""
    quiet = dataclasses.replace(metadata, slot_mapping=torch.full_like(metadata.slot_mapping, -1))
    rows = metadata.slot_mapping.shape[0]
    seen = set()
    with set_attention_metadata(quiet):
        for layer in layers:
            if layer.kv_spec in seen or layer.kv_spec.index_head_dim:
                continue
            seen.add(layer.kv_spec)
            backend_of(layer).forward(layer, *rehearsal_inputs(layer, rows))
    return len(seen)
