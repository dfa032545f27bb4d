"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): the attention layer over a latent KV
cache, and its backend (registered for kind "mla" in model_ops/attention_backends).

Per token the cache holds one row of kv_lora_rank + qk_rope_head_dim values (576 for V3): the
normalised latent c and the roped shared key part r. The backend normalises c, ropes q and r,
and stores [c, r] in one op (`mla_rope_store`), then attends in the absorbed form for every row
of the flat batch (prefill chunks and decode alike): kv_b_proj's key half is folded into the
query (q_latent = q_nope @ W_UK), the kernel averages latents, and the value half maps the
result back (o = o_latent @ W_UV^T). Kernels of the device's provider: `mla_rope_store`
(kernels/triton/mla_prep.py) and `mla_attention` (kernels/triton/mla.py); kernels/torch_ref.py and
kernels/mla_ref.py hold them for the CPU.
"""
from __future__ import annotations

import weakref

import torch
from torch import nn

from atom_core.kernels import kernel_ops
from atom_core.kernels.dsa_ref import hadamard_matrix
from atom_core.kernels.torch_ref import deinterleave
from atom_core.kernel_config import KernelConfig, build_kernel_config
from atom_core.model_ops.attention_backends import AttentionBackend, get_attention_backend
from atom_core.model_ops.forward_context import get_attention_metadata
from atom_core.model_ops.kv_spec import KVSpec
from atom_core.model_ops.layernorm import RMSNorm
from atom_core.model_ops.rotary import RotaryEmbedding

_LAYERS: "weakref.WeakValueDictionary[int, MLAAttention]" = weakref.WeakValueDictionary()


@torch.library.custom_op("atom::mla_attention", mutates_args=())
def mla_attention_op(q: torch.Tensor, kv_a: torch.Tensor, positions: torch.Tensor, layer_key: torch.Tensor,
                     out_width: int) -> torch.Tensor:
    """Opaque to torch.compile, as atom::paged_attention: the cache store is a side effect the
    compiler never sees; the layer (weights, cache views) is looked up by key."""
    layer = _LAYERS[int(layer_key)]
    return layer.backend(q.device).forward(layer, q, kv_a, positions)


@mla_attention_op.register_fake
def _(q, kv_a, positions, layer_key, out_width):
    return q.new_empty(q.shape[0], out_width)


class MLAAttention(nn.Module):
    """q [T, H, N + R] and kv_a [T, C + R] (kv_a_proj_with_mqa's output: the latent before
    kv_a_layernorm, then k_pe before RoPE) -> [T, H * V] for the flat batch in the forward context.

    `kv_a_layernorm` and `kv_b_proj` are the model's own layers (kept registered where the
    checkpoint names them; held here through plain references): the norm's weight and eps go to
    the fused rope + norm + store op; kv_b_proj's weight, whatever its quant format, is read back
    once as W_UK / W_UV for the absorbed form. `interleaved`: the rope dims come in (x0, x1)
    pairs (DeepSeek's layout) rather than neox halves. The KV spec is kind "mla": one row of C + R.
    """

    def __init__(self, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 kv_lora_rank: int, scale: float, rotary: RotaryEmbedding, kv_a_layernorm: RMSNorm,
                 kv_b_proj: nn.Module, interleaved: bool, prefix: str = ""):
        super().__init__()
        self.num_heads, self.v_head_dim = num_heads, v_head_dim
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank = qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank
        self.scale, self.interleaved, self.prefix = scale, interleaved, prefix
        self._refs = (rotary, kv_b_proj, kv_a_layernorm)  # not submodules: their owners register them
        self.dtype = torch.get_default_dtype()
        self.kv_spec = KVSpec("mla", 1, kv_lora_rank + qk_rope_head_dim, self.dtype)
        self.k_cache = self.v_cache = torch.empty(0)
        self.w_uk: torch.Tensor | None = None  # [H, N, C]
        self.w_uv_t: torch.Tensor | None = None  # [H, C, V]
        self._backend: AttentionBackend | None = None
        self.kernel_config = build_kernel_config()  # the backend's kernel choices (KernelConfig)
        self.layer_key = torch.tensor([id(self)], dtype=torch.int64, device="cpu")
        _LAYERS[id(self)] = self

    @property
    def rotary(self) -> RotaryEmbedding:
        return self._refs[0]

    @property
    def kv_a_layernorm(self) -> RMSNorm:
        return self._refs[2]

    def backend(self, device: torch.device) -> AttentionBackend:
        if self._backend is None:
            self._backend = get_attention_backend(self.kv_spec.kind, device, self.kernel_config)
        return self._backend

    @torch.no_grad()
    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, N, C], W_UV^T [H, C, V]) from kv_b_proj, on first use (after loading). A plain
        weight in the model dtype is viewed, not copied; any other format is read back once as
        kv_b_proj(I), its weight transposed, dequantized by its own quant method."""
        if self.w_uk is None:
            kv_b_proj = self._refs[1]
            weight = getattr(kv_b_proj, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.dtype == self.dtype and weight.dim() == 2:
                w = weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, -1)
            else:
                eye = torch.eye(self.kv_lora_rank, dtype=self.dtype, device=_device(kv_b_proj))
                w = kv_b_proj(eye).t().reshape(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, -1)
            self.w_uk = w[:, :self.qk_nope_head_dim]
            self.w_uv_t = w[:, self.qk_nope_head_dim:].transpose(1, 2)
        return self.w_uk, self.w_uv_t

    def forward(self, q: torch.Tensor, kv_a: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return mla_attention_op(q, kv_a, positions, self.layer_key, self.num_heads * self.v_head_dim)
        assert self.k_cache.numel() or not self.backend(q.device).needs_allocated_cache, \
            "KV cache not allocated for this MLA layer"
        return self.backend(q.device).forward(self, q, kv_a, positions)


def _device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


class MLABackend(AttentionBackend):
    """Absorbed MLA over the paged latent cache. No sliding window, no sinks."""

    name = "mla"

    def __init__(self, device_type: str, kernel: KernelConfig | None = None):
        super().__init__(device_type, kernel)
        self.ops = kernel_ops(device_type)

    def forward(self, layer: MLAAttention, q: torch.Tensor, kv_a: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
        meta = get_attention_metadata()
        num_tokens = q.shape[0]
        norm = layer.kv_a_layernorm
        q_rope = self.ops.mla_rope_store(q, kv_a, positions, layer.rotary.cos_sin_cache, layer.k_cache,
                                         meta.slot_mapping, norm.weight, norm.eps, layer.interleaved)  # [T, H, R]
        w_uk, w_uv_t = layer.absorbed_weights()
        q_nope = q[..., :layer.qk_nope_head_dim]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, C], rows strided
        o_latent = self.ops.mla_attention(q_latent, q_rope, layer.k_cache, meta.block_tables,
                                          meta.query_start_loc, meta.seq_lens, layer.scale, meta.max_query_len,
                                          meta.max_seq_len)
        out = torch.bmm(o_latent.transpose(0, 1), w_uv_t)  # [H, T, V]
        return out.transpose(0, 1).reshape(num_tokens, layer.num_heads * layer.v_head_dim)


# ---------------------------------------------------------------------------------------------
# DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): MLA over the index_topk tokens an indexer picks


@torch.library.custom_op("atom::sparse_mla_attention", mutates_args=())
def sparse_mla_attention_op(q: torch.Tensor, kv_a: torch.Tensor, positions: torch.Tensor, index_q: torch.Tensor,
                            index_k: torch.Tensor, index_w: torch.Tensor, layer_key: torch.Tensor,
                            out_width: int) -> torch.Tensor:
    """atom::mla_attention plus the indexer's query, key and head weights (its cache store is a
    side effect too)."""
    layer = _LAYERS[int(layer_key)]
    return layer.backend(q.device).forward(layer, q, kv_a, positions, index_q, index_k, index_w)


@sparse_mla_attention_op.register_fake
def _(q, kv_a, positions, index_q, index_k, index_w, layer_key, out_width):
    return q.new_empty(q.shape[0], out_width)


class TopkSelection:
    """The slots [T, index_topk] the last indexer layer of this forward selected (None: the step
    ran dense), for the layers that reuse it (GLM-5's "shared" layers). One per model; layers
    run in order, so a reader always sees its forward's selection."""

    def __init__(self):
        self.slots: torch.Tensor | None = None


class SparseMLAAttention(MLAAttention):
    """MLA with DeepSeek Sparse Attention: the layer's lightning indexer (its projections are the
    model's; this layer gets their outputs) scores the cached tokens, and MLA attends to the
    `index_topk` best of them per query token (kernels/dsa_ref.py holds the math).

    forward(q, kv_a, positions, index_q [T, Hi * D], index_k [T, D], index_w [T, Hi] float32,
    already times Hi^-0.5): the indexer's query and key before RoPE, which is applied to their
    first qk_rope_head_dim dims (neox halves, or pairs when `index_interleaved`: GLM-5) with the
    MLA rotary cache. A layer built with `has_indexer=False` (GLM-5's "shared" layers) takes no
    indexer inputs, stores no indexer keys and reuses the selection of the last indexer layer
    before it (`selection`, one per model).

    The KV spec is the MLA latent plus, with an indexer, index_head_dim values per token (the key
    cache `index_cache`, same blocks and slots). Dense/sparse switch: a step whose longest
    sequence (max_seq_len, with this step's tokens) is at most index_topk runs dense MLA, which is
    exact (every query keeps all the tokens it sees); any longer step selects for every row (rows
    seeing at most index_topk tokens still keep all of them).
    """

    def __init__(self, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 kv_lora_rank: int, scale: float, rotary: RotaryEmbedding, kv_a_layernorm: RMSNorm,
                 kv_b_proj: nn.Module, interleaved: bool, *, index_n_heads: int, index_head_dim: int,
                 index_topk: int, index_interleaved: bool, selection: TopkSelection, has_indexer: bool = True,
                 prefix: str = ""):
        super().__init__(num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank, scale, rotary,
                         kv_a_layernorm, kv_b_proj, interleaved, prefix)
        if index_topk < 1 or index_head_dim < qk_rope_head_dim:
            raise ValueError(f"index_topk {index_topk} must be >= 1 and index_head_dim {index_head_dim} >= "
                             f"qk_rope_head_dim {qk_rope_head_dim} (the indexer ropes its first dims)")
        self.index_n_heads, self.index_head_dim, self.index_topk = index_n_heads, index_head_dim, index_topk
        self.index_interleaved, self.has_indexer = index_interleaved, has_indexer
        self.index_scale = index_head_dim ** -0.5
        self.selection = selection
        self.kv_spec = KVSpec("mla", 1, kv_lora_rank + qk_rope_head_dim, self.dtype,
                              index_head_dim=index_head_dim if has_indexer else 0)
        self.index_cache = torch.empty(0)
        self.index_scale_cache: torch.Tensor | None = None  # FP8 indexer keys' scales (KVSpec.index_fp8)

    def backend(self, device: torch.device) -> AttentionBackend:
        if self._backend is None:
            self._backend = get_attention_backend("mla_sparse", device, self.kernel_config)
        return self._backend

    def forward(self, q: torch.Tensor, kv_a: torch.Tensor, positions: torch.Tensor,
                index_q: torch.Tensor | None = None, index_k: torch.Tensor | None = None,
                index_w: torch.Tensor | None = None) -> torch.Tensor:
        assert (index_q is not None) == self.has_indexer, f"{self.prefix}: indexer inputs iff the layer has one"
        if not self.has_indexer:
            return super().forward(q, kv_a, positions)
        if torch.compiler.is_compiling():
            return sparse_mla_attention_op(q, kv_a, positions, index_q, index_k, index_w, self.layer_key,
                                           self.num_heads * self.v_head_dim)
        assert self.k_cache.numel() or not self.backend(q.device).needs_allocated_cache, \
            "KV cache not allocated for this MLA layer"
        return self.backend(q.device).forward(self, q, kv_a, positions, index_q, index_k, index_w)


class SparseMLABackend(MLABackend):
    """Absorbed MLA over the index_topk slots the indexer selects per query token (dense MLA for
    steps that fit in index_topk, see SparseMLAAttention). Kernels of the provider:
    `dsa_index_scores`, `dsa_topk`, `mla_sparse_attention` (kernels/triton/dsa_index.py,
    kernels/triton/dsa_mla.py; kernels/dsa_ref.py on the CPU). No host sync: the switch reads
    max_seq_len, a host int (max_model_len inside decode graphs)."""

    name = "mla-sparse"

    def forward(self, layer: SparseMLAAttention, q: torch.Tensor, kv_a: torch.Tensor, positions: torch.Tensor,
                index_q: torch.Tensor | None = None, index_k: torch.Tensor | None = None,
                index_w: torch.Tensor | None = None) -> torch.Tensor:
        meta = get_attention_metadata()
        num_tokens = q.shape[0]
        norm = layer.kv_a_layernorm
        q_rope = self.ops.mla_rope_store(q, kv_a, positions, layer.rotary.cos_sin_cache, layer.k_cache,
                                         meta.slot_mapping, norm.weight, norm.eps, layer.interleaved)  # [T, H, R]
        if layer.has_indexer:
            index_q = self._rope_store_index_keys(layer, index_q, index_k, positions, meta.slot_mapping)
            slots = None
            if meta.max_seq_len > layer.index_topk:
                slots = self.select(layer, index_q, index_w, meta)
            layer.selection.slots = slots
        else:
            slots = layer.selection.slots if meta.max_seq_len > layer.index_topk else None
        w_uk, w_uv_t = layer.absorbed_weights()
        q_latent = torch.bmm(q[..., :layer.qk_nope_head_dim].transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, C]
        if slots is None:
            o_latent = self.ops.mla_attention(q_latent, q_rope, layer.k_cache, meta.block_tables,
                                              meta.query_start_loc, meta.seq_lens, layer.scale, meta.max_query_len,
                                              meta.max_seq_len)
        else:
            o_latent = self.ops.mla_sparse_attention(q_latent, q_rope, layer.k_cache, slots, layer.scale)
        out = torch.bmm(o_latent.transpose(0, 1), w_uv_t)  # [H, T, V]
        return out.transpose(0, 1).reshape(num_tokens, layer.num_heads * layer.v_head_dim)

    def _rope_store_index_keys(self, layer: SparseMLAAttention, index_q: torch.Tensor, index_k: torch.Tensor,
                               positions: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """RoPE on the indexer's query and key (their first qk_rope_head_dim dims), the key into
        index_cache; returns the roped query [T, Hi, D]. Interleaved pairs become neox halves in
        both (a common permutation of the dims: the dot products stay those of the pairs)."""
        num_tokens, rope = index_q.shape[0], layer.qk_rope_head_dim
        iq = index_q.view(num_tokens, layer.index_n_heads, layer.index_head_dim)
        ik = index_k.view(num_tokens, 1, layer.index_head_dim)
        if layer.index_interleaved:
            iq = torch.cat([deinterleave(iq[..., :rope]), iq[..., rope:]], dim=-1)
            ik = torch.cat([deinterleave(ik[..., :rope]), ik[..., rope:]], dim=-1)
        else:  # fresh tensors: the rotary kernel works in place, and the inputs are the op's arguments
            iq, ik = iq.clone(), ik.clone()
        iq, ik = self.ops.rotary_embedding(positions, iq, ik, layer.rotary.cos_sin_cache)
        if layer.kv_spec.index_fp8:  # the public recipe: rotate both, store the key as e4m3 per 128-value group
            rotation = self._hadamard(layer.index_head_dim, iq.device)
            iq = (iq.float() @ rotation).to(iq.dtype)
            ik = (ik.float() @ rotation).view(num_tokens, *layer.index_cache.shape[2:])  # [T, G, D / G]
            scales = layer.index_scale_cache
            self.ops.store_kv_cache(ik, ik, layer.index_cache, layer.index_cache, slot_mapping, scales, scales)
            return iq
        ik = ik.to(layer.index_cache.dtype)
        self.ops.store_kv_cache(ik, ik, layer.index_cache, layer.index_cache, slot_mapping)
        return iq

    def _hadamard(self, dim: int, device: torch.device) -> torch.Tensor:
        """The indexer's rotation [dim, dim] float32, built on first use (warm-up, before any graph)."""
        cached = getattr(self, "_rotation", None)
        if cached is None or cached.shape[0] != dim or cached.device != device:
            self._rotation = cached = hadamard_matrix(dim, device)
        return cached

    def select(self, layer: SparseMLAAttention, index_q: torch.Tensor, index_w: torch.Tensor,
               meta) -> torch.Tensor:
        """The slots [T, index_topk] each query row attends to (-1 padded)."""
        scores = self.ops.dsa_index_scores(index_q, index_w, layer.index_cache, meta.block_tables,
                                           meta.query_start_loc, meta.seq_lens, layer.index_scale, meta.max_seq_len,
                                           meta.max_query_len, layer.index_scale_cache)
        return self.ops.dsa_topk(scores, layer.index_topk, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                 layer.index_cache.shape[1], meta.max_query_len)
