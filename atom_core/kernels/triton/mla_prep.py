"""MLA's projections -> the latent attention's inputs, one launch (Triton): RoPE on every head's
query rope part and on k_pe, RMSNorm of the latent (kv_a_layernorm), and the cache row
[latent | roped k_pe] into the paged latent cache. Contract and oracle: `kernels.torch_ref.mla_rope_store`.

Unfused these were five launches per layer at batch 1 (two cats de-interleaving the rope pairs,
the rotary kernel, the cat of the cache row, the store) plus the norm: about a third of an MLA
layer's time at batch 1, nearly all launch gaps (measured: see docs/PERFORMANCE.md). One program per token; the query
heads go through in tiles of BLOCK_H. Arithmetic follows the unfused kernels step by step
(rope in fp32, rounded once; the norm rounded before the weight multiply, as rms_norm does).

Rope layout: pair i of a head is (x[i * PAIR_STEP], x[i * PAIR_STEP + PAIR_OFFSET]): (2i, 2i + 1)
for DeepSeek's interleaved pairs, (i, R/2 + i) for neox halves. Either way the result is written
as neox halves, the layout the latent attention kernel and the cache already use.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_core.kernels.triton.common import (
    check_dim, check_float, check_int, check_last_dim_contiguous, check_same_device, next_pow2,
)
from atom_core.kernels.triton.norm import normalize

# Query elements per head tile: with 4 warps ~8 per thread for each of the pair's halves, so
# V3's 128 heads take 4 tiles without spilling (V2-Lite's 16 heads take one).
Q_TILE_ELEMS = 1024


@triton.jit
def _rope_pairs(first, mask, cos, sin, PAIR_OFFSET: tl.constexpr):
    """Pointers `first` at each pair's first element -> the rotated pair (fp32)."""
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + PAIR_OFFSET, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _mla_rope_store_kernel(
    q_ptr, kv_a_ptr, positions_ptr, cos_sin_ptr, norm_w_ptr, q_rope_ptr, kv_cache_ptr, slot_mapping_ptr,
    eps, block_size, stride_qt, stride_qh, stride_kvat, stride_cs, stride_qrt, stride_cb, stride_cslot,
    NUM_HEADS: tl.constexpr, NOPE: tl.constexpr, LATENT: tl.constexpr, HALF: tl.constexpr,
    PAIR_STEP: tl.constexpr, PAIR_OFFSET: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_C: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_i = tl.arange(0, BLOCK_HALF)
    i_ok = offs_i < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_i, mask=i_ok, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_i, mask=i_ok, other=0.0)

    # Query: every head's rope part -> q_rope [T, H, R] (padding tokens too: their rows are unused).
    q_first = q_ptr + token * stride_qt + NOPE + offs_i[None, :] * PAIR_STEP
    q_out = q_rope_ptr + token * stride_qrt + offs_i[None, :]
    for h0 in range(0, NUM_HEADS, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)[:, None]
        mask = (offs_h < NUM_HEADS) & i_ok[None, :]
        o1, o2 = _rope_pairs(q_first + offs_h * stride_qh, mask, cos[None, :], sin[None, :], PAIR_OFFSET)
        dst = q_out + offs_h * (2 * HALF)
        tl.store(dst, o1.to(q_rope_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, o2.to(q_rope_ptr.dtype.element_ty), mask=mask)

    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padded token of a CUDA-graph batch: it owns no slot
        return
    row = kv_cache_ptr + (slot // block_size) * stride_cb + (slot % block_size) * stride_cslot
    kv_a = kv_a_ptr + token * stride_kvat
    cache_ty = kv_cache_ptr.dtype.element_ty
    offs_c = tl.arange(0, BLOCK_C)
    c_ok = offs_c < LATENT
    latent = tl.load(kv_a + offs_c[None, :], mask=c_ok[None, :], other=0.0).to(tl.float32)  # [1, C]
    latent = normalize(latent, norm_w_ptr, offs_c, c_ok, LATENT, eps, kv_a_ptr.dtype.element_ty)
    tl.store(row + offs_c[None, :], latent.to(cache_ty), mask=c_ok[None, :])
    k1, k2 = _rope_pairs(kv_a + LATENT + offs_i * PAIR_STEP, i_ok, cos, sin, PAIR_OFFSET)
    tl.store(row + LATENT + offs_i, k1.to(cache_ty), mask=i_ok)
    tl.store(row + LATENT + HALF + offs_i, k2.to(cache_ty), mask=i_ok)


def _check_args(q, kv_a, positions, cos_sin_cache, kv_cache, slot_mapping, kv_norm_weight):
    for name, t, n in (("q", q, 3), ("kv_a", kv_a, 2), ("kv_cache", kv_cache, 4), ("cos_sin_cache", cos_sin_cache, 2),
                       ("kv_norm_weight", kv_norm_weight, 1)):
        check_dim(name, t, n)
        check_last_dim_contiguous(name, t)
    for name, t in (("q", q), ("kv_a", kv_a), ("kv_cache", kv_cache), ("kv_norm_weight", kv_norm_weight)):
        check_float(name, t)
    check_int("positions", positions)
    check_int("slot_mapping", slot_mapping)
    if cos_sin_cache.dtype != torch.float32:
        raise ValueError(f"cos_sin_cache must be float32, got {cos_sin_cache.dtype}")
    num_tokens, rope = q.shape[0], cos_sin_cache.shape[1]
    latent = kv_cache.shape[3] - rope
    if rope % 2 or q.shape[2] <= rope or latent <= 0:
        raise ValueError(f"the rope dim {rope} (cos_sin_cache) must be even and below q's head {q.shape[2]} "
                         f"and the cache row {kv_cache.shape[3]}")
    if kv_a.shape != (num_tokens, latent + rope) or kv_norm_weight.shape != (latent,):
        raise ValueError(f"kv_a {tuple(kv_a.shape)} must be [{num_tokens}, {latent} + {rope}] and kv_norm_weight "
                         f"{tuple(kv_norm_weight.shape)} [{latent}] for the cache row {kv_cache.shape[3]}")
    if kv_cache.shape[2] != 1:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} must be [NB, BS, 1, C + R]: one latent row a token")
    if positions.shape != (num_tokens,) or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"positions {tuple(positions.shape)} and slot_mapping {tuple(slot_mapping.shape)} "
                         f"must be [{num_tokens}]")
    if not q.dtype == kv_a.dtype == kv_cache.dtype:
        raise ValueError(f"q {q.dtype}, kv_a {kv_a.dtype} and kv_cache {kv_cache.dtype} must share a dtype")
    check_same_device(q=q, kv_a=kv_a, positions=positions, cos_sin_cache=cos_sin_cache, kv_cache=kv_cache,
                      slot_mapping=slot_mapping, kv_norm_weight=kv_norm_weight)


def mla_rope_store(
    q: torch.Tensor,  # [T, H, N + R]
    kv_a: torch.Tensor,  # [T, C + R]
    positions: torch.Tensor,  # [T] int
    cos_sin_cache: torch.Tensor,  # [max_pos, R] float32
    kv_cache: torch.Tensor,  # [NB, BS, 1, C + R]
    slot_mapping: torch.Tensor,  # [T] int; < 0 means skip (padding)
    kv_norm_weight: torch.Tensor,  # [C]
    eps: float,
    interleaved: bool,
) -> torch.Tensor:
    """Same contract as `kernels.torch_ref.mla_rope_store`: returns q_rope [T, H, R]; the cache row
    [rms_norm(latent) | rope(k_pe)] goes to each token's slot."""
    _check_args(q, kv_a, positions, cos_sin_cache, kv_cache, slot_mapping, kv_norm_weight)
    num_tokens, num_heads, head_dim = q.shape
    rope = cos_sin_cache.shape[1]
    half, latent = rope // 2, kv_cache.shape[3] - rope
    q_rope = torch.empty(num_tokens, num_heads, rope, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_rope
    block_half = next_pow2(half)
    _mla_rope_store_kernel[(num_tokens,)](
        q, kv_a, positions, cos_sin_cache, kv_norm_weight, q_rope, kv_cache, slot_mapping,
        eps, kv_cache.shape[1], q.stride(0), q.stride(1), kv_a.stride(0), cos_sin_cache.stride(0), q_rope.stride(0),
        kv_cache.stride(0), kv_cache.stride(1),
        NUM_HEADS=num_heads, NOPE=head_dim - rope, LATENT=latent, HALF=half,
        PAIR_STEP=2 if interleaved else 1, PAIR_OFFSET=1 if interleaved else half,
        BLOCK_H=min(next_pow2(num_heads), max(1, Q_TILE_ELEMS // block_half)), BLOCK_HALF=block_half,
        BLOCK_C=next_pow2(latent), num_warps=4,
    )
    return q_rope
