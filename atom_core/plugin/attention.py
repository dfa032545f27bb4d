"""atom_core's attention inside vLLM: each of our attention layers (paged MHA/GQA with its window and
sinks, MLA over the latent cache) is announced to vLLM as an attention layer with its own backend,
so vLLM's KV manager sizes and allocates its cache from our KV spec and its runner builds our
metadata from its batch; our kernels then read vLLM's cache, block tables and slot mapping
(`query_start_loc`, `seq_lens`, `block_table`, `slot_mapping`: the fields of our own metadata).

vLLM's side of a layer (`KVCacheBinding`): registered in the compilation config's
`static_forward_context` under the layer's prefix (how vLLM finds attention layers), it answers
`get_kv_cache_spec` (FullAttentionSpec, SlidingWindowSpec or MLAAttentionSpec from our KVSpec) and
`get_attn_backend` (ours), and when vLLM binds the allocated cache to it, it hands our layer K/V
views of it [num_blocks, block_size, kv_heads, head_size] (MLA: the latent [.., 1, C + R]), the
views our engine gives each layer (how they sit in vLLM's tensor: compat.attention_views).

Our side: every layer's `_backend` becomes a `VllmMetadataBackend`, which looks up this step's
metadata for its layer name in vLLM's forward context (per layer: vLLM gives layers of different
KV groups, e.g. sliding-window and full, different block tables), sets it as our forward context
and runs the atom_core backend of the device (Triton on CUDA, the torch reference on the CPU). A
forward without metadata (vLLM's memory-profiling run, before any cache exists) returns zeros, as
vLLM's own layers do.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import torch

from atom_core.model_ops.attention_backends import get_attention_backend
from atom_core.model_ops.forward_context import AttentionMetadata, set_attention_metadata
from atom_core.plugin import compat
from atom_core.plugin.padded_rows import attend_real_rows
from atom_core.plugin.rehearsal import rehearse_attention
from atom_core.worker.batch_builder import context_split


class VllmMetadataBackend:
    """One layer's atom_core backend fed with the metadata vLLM built for that layer."""

    def __init__(self, layer, layer_name: str, device: torch.device):
        self.layer_name = layer_name
        self.inner = get_attention_backend(layer.kv_spec.kind, device, layer.kernel_config)
        self.name = f"vllm:{self.inner.name}"
        self.writes_out = False  # vLLM passes no output buffer: our piecewise graphs do not run here
        self.needs_allocated_cache = False  # vLLM's profiling forward, before any cache: answered below

    def forward(self, layer, first: torch.Tensor, *args) -> torch.Tensor:
        metadata = compat.layer_metadata(self.layer_name)
        if metadata is None:  # vLLM's profiling run: no cache yet, and the output is never read
            width = layer.num_heads * (layer.v_head_dim if layer.kv_spec.kind == "mla" else layer.head_dim)
            return first.new_zeros(first.shape[0], width)
        with set_attention_metadata(metadata):  # a step vLLM padded past its tokens: padded_rows.py
            return attend_real_rows(self.inner, layer, metadata, first, *args)

    def warm_up(self, layers: list, max_tokens: int, threads: int) -> int:
        return self.inner.warm_up(layers, max_tokens, threads)


class AtomMetadataBuilder(compat.AttentionMetadataBuilder):
    """vLLM's CommonAttentionMetadata -> our AttentionMetadata. The tensors are vLLM's (its persistent
    buffers, so CUDA graphs replay on them); a step with prefill rows also gets our split by cached
    context (which sequences' keys are all this step's rows), built from vLLM's host copies, so the
    Triton backend runs fresh prompts through the contiguous prefill kernel."""

    _cudagraph_support = compat.AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    reorder_batch_threshold = None

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.max_model_len = vllm_config.model_config.max_model_len
        self.max_num_batched_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self.forward_context = vllm_config.compilation_config.static_forward_context
        self.device = device
        self.warmed_up = False

    def build(self, common_prefix_len: int, common_attn_metadata, fast_build: bool = False) -> AttentionMetadata:
        cm = common_attn_metadata
        metadata = AttentionMetadata(
            query_start_loc=cm.query_start_loc, seq_lens=cm.seq_lens, block_tables=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping.to(torch.int64), max_query_len=int(cm.max_query_len),
            max_seq_len=int(cm.max_seq_len))
        if cm.max_query_len > 1:
            return dataclasses.replace(metadata, **self._context_split(cm))
        return metadata

    def build_for_cudagraph_capture(self, common_attn_metadata) -> AttentionMetadata:
        # A captured decode launch must cover any context a replay brings: size its grid for the longest.
        self._warm_up()
        self._capture_prefill_graphs()
        metadata = dataclasses.replace(self.build(0, common_attn_metadata), max_seq_len=self.max_model_len)
        if self.device.type == "cuda":  # the graph's kernel variants compiled now, outside it (rehearsal.py)
            rehearse_attention(self._layers(), metadata, lambda layer: layer._backend.inner)
        return metadata

    def _layers(self) -> list:
        return [self.forward_context[name].layer for name in self.layer_names]

    def _warm_up(self) -> None:
        """Compile every attention kernel variant of this builder's layers once, at vLLM's first capture
        (outside the graph, the caches bound), so no step of the run pays a compile: our engine warms
        up the same way at start-up. What each graph holds is rehearsed per capture (rehearsal.py)."""
        if self.warmed_up or self.device.type != "cuda":
            return
        from atom_core.model_ops.kv_spec import warm_up_attention

        longest = min(self.max_num_batched_tokens, self.max_model_len)
        warm_up_attention(self._layers(), longest, min(8, os.cpu_count() or 1))
        self.warmed_up = True

    def _capture_prefill_graphs(self) -> None:
        """Our piecewise graphs for the steps vLLM runs eagerly (prefill_graphs.py), once per model:
        here the caches are bound and no vLLM step is running."""
        graphs = getattr(self.forward_context[self.layer_names[0]], "prefill_graphs", None)
        if graphs is not None:
            graphs.capture()

    def _context_split(self, cm) -> dict:
        query_lens = np.diff(cm.query_start_loc_cpu[: cm.num_reqs + 1].numpy())
        seq_lens = compat.host_seq_lens(cm)
        out = context_split(query_lens.tolist(), seq_lens.tolist())
        return {name: torch.from_numpy(value).to(self.device, non_blocking=True) if isinstance(value, np.ndarray)
                else value for name, value in out.items()}


class AtomAttentionBackend(compat.AttentionBackend):
    """vLLM's view of atom_core's paged MHA/GQA (our layers call our kernels themselves: vLLM never
    builds an implementation object of this backend)."""

    accept_output_buffer = False
    forward_includes_kv_cache_update = True
    supported_dtypes = [torch.float16, torch.bfloat16, torch.float32]

    @staticmethod
    def get_name() -> str:
        return "ATOM_PAGED_ATTN"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("atom_core's attention layers run their own kernels (VllmMetadataBackend); "
                                  "vLLM builds no implementation object for this backend")

    @staticmethod
    def get_builder_cls():
        return AtomMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        # How vLLM 0.20 shapes each layer's cache (0.32 gives logical page views: plugin/kv_layout.py).
        return compat.kv_cache_shape("mha", num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:  # 0.32 passes the spec, 0.20 nothing
        return [compat.MultipleOf(16)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any: the kernels take the head size as a compile-time argument

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def is_mla(cls) -> bool:
        return False


class AtomMLABackend(AtomAttentionBackend):
    """vLLM's view of atom_core's absorbed MLA over the latent cache: one row of C + R per token."""

    @staticmethod
    def get_name() -> str:
        return "ATOM_MLA"

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return compat.kv_cache_shape("mla", num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def is_mla(cls) -> bool:
        return True


class KVCacheBinding(compat.AttentionLayerBase):
    """What vLLM sees of one atom_core attention layer: its KV spec, its backend, and the cache
    vLLM binds to it (`kv_cache`, set after allocation), whose views go to our layer."""

    def __init__(self, layer, layer_name: str):
        self.layer, self.layer_name = layer, layer_name
        self.impl = None  # vLLM's attention implementation object: ours lives in the layer
        self.prefill_graphs = None  # the model's piecewise graphs (prefill_graphs.py), captured by our builder
        self._kv_cache = None

    def get_attn_backend(self):
        return AtomMLABackend if self.layer.kv_spec.kind == "mla" else AtomAttentionBackend

    def get_kv_cache_spec(self, vllm_config):
        spec = self.layer.kv_spec
        cache_dtype = vllm_config.cache_config.cache_dtype
        if cache_dtype != "auto":
            raise ValueError(f"--kv-cache-dtype {cache_dtype} is not supported by atom_core's attention in vLLM; "
                             f"use auto, or set ATOM_DISABLE_VLLM_PLUGIN=1 to run vLLM's own model classes")
        return compat.kv_cache_spec(spec, vllm_config.cache_config.block_size)

    @property
    def kv_cache(self):
        return self._kv_cache

    @kv_cache.setter
    def kv_cache(self, cache) -> None:
        self._kv_cache = cache
        tensor = cache[0] if isinstance(cache, (list, tuple)) and cache else cache  # older: one per virtual engine
        if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:  # released (vLLM's sleep mode)
            self.layer.k_cache = self.layer.v_cache = torch.empty(0)
            return
        self.layer.k_cache, self.layer.v_cache = compat.attention_views(tensor, self.layer.kv_spec.kind)


def register_attention_layers(model: torch.nn.Module, vllm_config, device: torch.device) -> list[KVCacheBinding]:
    """Announce every atom_core attention layer of `model` to vLLM and route it through vLLM's
    metadata; returns the bindings (vLLM's forward context holds them too)."""
    from atom_core.model_ops.kv_spec import attention_layers

    context = vllm_config.compilation_config.static_forward_context
    bindings = []
    for layer in attention_layers(model):
        name = layer.prefix
        assert name not in context, f"attention layer name {name!r} already in vLLM's forward context"
        layer._backend = VllmMetadataBackend(layer, name, device)
        context[name] = binding = KVCacheBinding(layer, name)
        bindings.append(binding)
    return bindings
