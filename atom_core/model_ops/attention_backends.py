"""Attention backends, chosen by (attention kind, device type, KernelConfig) and built on first use.

A backend turns a layer's fused QKV projection output into attention output for the flat
batch in the forward context. It reads everything layer-specific (heads, scale, q/k norms,
the rotary cache and its width, the KV cache views) from the layer, so the custom op that
calls it passes only tensors and the layer key, and a new family adds no op argument.
"""
from __future__ import annotations

import importlib
from functools import partial
from typing import TYPE_CHECKING

import torch

from atom_core.kernel_config import KernelConfig
from atom_core.kernels import kernel_ops
from atom_core.model_ops.forward_context import AttentionMetadata, get_attention_metadata

if TYPE_CHECKING:
    from atom_core.model_ops.attention import Attention


class AttentionBackend:
    """Contract: `forward` stores this step's K/V into the layer's cache (slots from the
    metadata; slot < 0 = padding, stored nowhere) and returns [T, H * D]. It must not sync
    the host, so CUDA graphs can capture it. The supports_* flags are what
    kv_spec.check_attention_supported refuses a model on; `writes_out`: forward takes `out=`, a
    [T, H * D] tensor it writes its result into and returns (piecewise graphs pass their static
    output buffer, so no copy follows the eager attention). Every choice a backend makes about its
    kernels it makes in `__init__`, from the device type and the KernelConfig of its layers.
    `needs_allocated_cache`: a layer refuses to run before its cache is allocated (a missed
    allocation); a backend that answers a cacheless forward itself (plugin mode: vLLM's
    memory-profiling run comes before vLLM allocates any cache) sets it False."""

    name = "base"
    supports_sliding_window = False
    supports_sinks = False
    writes_out = False
    needs_allocated_cache = True

    def __init__(self, device_type: str, kernel: KernelConfig | None = None):
        self.device_type = device_type
        self.kernel = kernel if kernel is not None else KernelConfig()

    def forward(self, layer: "Attention", qkv: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def warm_up(self, layers: list["Attention"], max_tokens: int, threads: int) -> int:
        """Compile what later steps would otherwise compile mid-run; returns kernels launched."""
        return 0


class PagedMHABackend(AttentionBackend):
    """Paged MHA/GQA: q/k-norm + neox RoPE + KV store in one kernel, then paged attention.
    The kernel provider comes from the device (Triton on CUDA/ROCm, torch_ref on the CPU).

    On CUDA: sequences without cached context (a prompt's first chunk) attend over the step's own
    K/V rows (kernels/triton/prefill_attention.py), the rest through the paged kernel; a step with
    both decodes and chunks with cached context gives them separate paged launches. The CPU reference
    runs every sequence in one paged launch."""

    name = "paged-mha"
    supports_sliding_window = True  # both providers (torch_ref, Triton) mask a per-layer window
    supports_sinks = True  # and add a per-head sink to the softmax denominator
    writes_out = True

    def __init__(self, device_type: str, kernel: KernelConfig | None = None):
        super().__init__(device_type, kernel)
        self.ops = kernel_ops(device_type)
        self.prefill = None  # the contiguous prefill kernels' module (CUDA only)
        self.launch: dict = {}  # the Triton wrappers' launch option
        if device_type == "cuda":
            from atom_core.kernels.triton import prefill_attention

            self.prefill = prefill_attention
            self.launch = {"direct_launch": self.kernel.triton_fast_launch}

    def forward(self, layer: "Attention", qkv: torch.Tensor, positions: torch.Tensor,
                out: torch.Tensor | None = None, cos_sin: torch.Tensor | None = None) -> torch.Tensor:
        """cos_sin: the rows' own [T, rotary_dim] table (multimodal RoPE; positions then index it) in
        place of the layer's rotary cache."""
        meta = get_attention_metadata()
        if cos_sin is None:
            cos_sin = layer.qk.rotary.cos_sin_cache
        q_norm, k_norm = layer.qk.q_norm, layer.qk.k_norm
        norm = (q_norm.weight, k_norm.weight, q_norm.eps) if q_norm is not None else (None, None, 1e-6)
        scales = self._kv_scales(layer)
        q = self.ops.qkv_rope_store(qkv, positions, cos_sin, layer.k_cache, layer.v_cache,
                                    meta.slot_mapping, layer.num_heads, *norm, **scales, **self.launch)
        if out is not None:
            out = out.view(q.shape)
        if self.prefill is not None and meta.fresh_seq_ids is not None and not scales:
            out = self._split_by_context(layer, meta, qkv, positions, q, k_norm, out, cos_sin)
            return out.view(-1, layer.num_heads * layer.head_dim)
        out = self._paged_attention(layer, meta, q, out, scales, with_fresh=True)
        return out.view(-1, layer.num_heads * layer.head_dim)

    def _paged_launches(self, meta: AttentionMetadata, with_fresh: bool) -> list[tuple[int, torch.Tensor | None]]:
        """(max_query_len, seq_order) of each paged kernel launch over every sequence (with_fresh) or
        over those with cached context. A step holding decodes and chunks gives the decodes their
        own launch, so they get the decode tile, heads-inner order and split-KV instead of riding in
        the chunk's tile; the launches write disjoint rows of `out`."""
        if self._splits_mixed(meta):
            launches = [(1, meta.decode_seq_ids), (meta.chunk_max_query_len, meta.chunk_seq_ids)]
            if with_fresh and meta.fresh_seq_ids is not None:  # fresh ones not on the contiguous path (FP8)
                launches.append((meta.fresh_max_query_len, meta.fresh_seq_ids))
            return launches
        if with_fresh:
            return [(meta.max_query_len, meta.seq_order)]
        return [] if meta.paged_seq_ids is None else [(meta.paged_max_query_len, meta.paged_seq_ids)]

    def _paged_attention(self, layer: "Attention", meta: AttentionMetadata, q: torch.Tensor,
                         out: torch.Tensor | None, scales: dict, with_fresh: bool) -> torch.Tensor | None:
        for max_query_len, seq_order in self._paged_launches(meta, with_fresh):
            out = self.ops.paged_attention(q, layer.k_cache, layer.v_cache, meta.block_tables, meta.query_start_loc,
                                           meta.seq_lens, layer.scale, max_query_len, meta.max_seq_len, out,
                                           seq_order=seq_order, **self._layer_args(layer), **scales, **self.launch)
        return out

    def _splits_mixed(self, meta: AttentionMetadata) -> bool:
        """Whether decodes and chunks get separate launches: only on the Triton provider (the CPU
        reference computes every row alike) and only when the batch builder listed both kinds."""
        return self.device_type == "cuda" and meta.decode_seq_ids is not None and meta.chunk_seq_ids is not None

    def _split_by_context(self, layer: "Attention", meta, qkv: torch.Tensor, positions: torch.Tensor,
                          q: torch.Tensor, k_norm, out: torch.Tensor | None,
                          cos_sin: torch.Tensor | None = None) -> torch.Tensor:
        """Sequences without cached context attend over this step's own K/V rows; the rest (chunks
        with context, decodes) through the paged kernel. Each launch writes only its own
        sequences' rows of `out` (split-KV too), so their order is free. Only for caches in the
        model dtype (FP8 caches hold codes, which the reference attends over)."""
        if out is None:
            out = torch.empty_like(q)
        args = self._layer_args(layer)
        self._paged_attention(layer, meta, q, out, {}, with_fresh=False)
        num_kv_heads, head_dim = layer.k_cache.shape[2], layer.head_dim
        k_norm_args = (k_norm.weight, k_norm.eps) if k_norm is not None else (None, 1e-6)
        cos_sin = layer.qk.rotary.cos_sin_cache if cos_sin is None else cos_sin
        k = self.prefill.rope_k_rows(qkv, positions, cos_sin, layer.num_heads, num_kv_heads,
                                     *k_norm_args, **self.launch)
        v = qkv[:, (layer.num_heads + num_kv_heads) * head_dim:].view(-1, num_kv_heads, head_dim)
        return self.prefill.prefill_attention(q, k, v, meta.query_start_loc, meta.fresh_seq_ids, layer.scale,
                                              meta.fresh_max_query_len, out, **args, **self.launch)

    @staticmethod
    def _kv_scales(layer: "Attention") -> dict:
        """An FP8 cache holds K / k_scale and V / v_scale: per-layer floats, or with per-token-head
        scales the layer's [NB, BS, KH] float32 scale caches (the store writes them, attention
        reads them); a cache in the model dtype needs none."""
        if layer.kv_spec.per_token_head_scales:
            assert layer.k_scale_cache is not None, "per-token-head KV scales not allocated for this layer"
            return {"k_scale": layer.k_scale_cache, "v_scale": layer.v_scale_cache}
        if layer.kv_spec.dtype == layer.dtype:
            return {}
        return {"k_scale": layer.kv_scales[0], "v_scale": layer.kv_scales[1]}

    @staticmethod
    def _layer_args(layer: "Attention") -> dict:
        """The layer's options the kernels take: its sliding window and its sinks, where it has them."""
        args = {}
        if layer.kv_spec.sliding_window is not None:
            args["sliding_window"] = layer.kv_spec.sliding_window
        if layer.kv_spec.has_sinks:
            args["sinks"] = layer.sinks
        return args

    def warm_up(self, layers: list["Attention"], max_tokens: int, threads: int) -> int:
        if self.device_type != "cuda":
            return 0
        from atom_core.kernels.triton.attention import warm_up_variants

        count, seen = 0, set()
        for layer in layers:  # variants depend on the head layout, dtype, window / sinks and per-token scales
            args = self._layer_args(layer)
            key = (tuple(layer.k_cache.shape[1:]), layer.k_cache.dtype, layer.dtype, layer.num_heads,
                   tuple(sorted(args)), layer.kv_spec.per_token_head_scales)
            if key not in seen:
                seen.add(key)
                scales = self._kv_scales(layer)
                variants = partial(warm_up_variants, layer.k_cache, layer.v_cache, layer.num_heads, layer.dtype,
                                   max_tokens, threads=threads, **args, **scales)
                count += variants()
                # The paged kernel runs with a seq_order subset for the paged part (no FP8) and for
                # each kind of a mixed step (FP8 too).
                count += variants(ordered_prefill=True)
                if not scales:
                    count += self._warm_up_split_by_context(layer)
        return count

    def _warm_up_split_by_context(self, layer: "Attention") -> int:
        """The split path's own kernels: K rows and contiguous attention (a fresh-only step)."""
        num_kv_heads, dev = layer.k_cache.shape[2], layer.k_cache.device
        qkv = torch.zeros(2, (layer.num_heads + 2 * num_kv_heads) * layer.head_dim, dtype=layer.dtype, device=dev)
        positions = torch.zeros(2, dtype=torch.int64, device=dev)
        slots = torch.full((2,), -1, dtype=torch.int64, device=dev)  # store nothing into the real cache
        k_norm = layer.qk.k_norm
        norm = (layer.qk.q_norm.weight, k_norm.weight, k_norm.eps) if k_norm is not None else (None, None, 1e-6)
        q = self.ops.qkv_rope_store(qkv, positions, layer.qk.rotary.cos_sin_cache, layer.k_cache, layer.v_cache,
                                    slots, layer.num_heads, *norm, **self.launch)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, 2], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([2], dtype=torch.int32, device=dev),
            block_tables=torch.zeros(1, 1, dtype=torch.int32, device=dev),
            slot_mapping=slots, max_query_len=2, max_seq_len=2,
            fresh_seq_ids=torch.zeros(1, dtype=torch.int32, device=dev), fresh_max_query_len=2)
        self._split_by_context(layer, meta, qkv, positions, q, k_norm, None)
        return 2


# (kind, device type) -> (module, class); imported on first use.
_BACKENDS: dict[tuple[str, str], tuple[str, str]] = {
    ("mha", "cuda"): (__name__, "PagedMHABackend"),
    ("mha", "cpu"): (__name__, "PagedMHABackend"),
    ("mla", "cuda"): ("atom_core.model_ops.mla", "MLABackend"),
    ("mla", "cpu"): ("atom_core.model_ops.mla", "MLABackend"),
    ("mla_sparse", "cuda"): ("atom_core.model_ops.mla", "SparseMLABackend"),
    ("mla_sparse", "cpu"): ("atom_core.model_ops.mla", "SparseMLABackend"),
}
_INSTANCES: dict[tuple[str, str, KernelConfig], AttentionBackend] = {}


def get_attention_backend(kind: str, device: torch.device | str,
                          kernel: KernelConfig | None = None) -> AttentionBackend:
    """The backend of `kind` attention on `device` under `kernel` (default: KernelConfig()), one per key."""
    device_type = torch.device(device).type
    kernel = kernel if kernel is not None else KernelConfig()
    backend = _INSTANCES.get((kind, device_type, kernel))
    if backend is None:
        if (kind, device_type) not in _BACKENDS:
            known = ", ".join(f"{k}@{d}" for k, d in sorted(_BACKENDS))
            raise ValueError(f"no attention backend for {kind!r} attention on {device_type!r}; available: {known}")
        module, cls = _BACKENDS[(kind, device_type)]
        backend = getattr(importlib.import_module(module), cls)(device_type, kernel)
        _INSTANCES[(kind, device_type, kernel)] = backend
    return backend
