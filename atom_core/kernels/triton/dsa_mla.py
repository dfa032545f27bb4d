"""Sparse MLA (Triton): absorbed MLA of each query row over its own list of cache slots (the
indexer's top-k); the torch reference with the same signature is `kernels/dsa_ref.py`
(`mla_sparse_attention`).

Work split: one program per (query row, BLOCK_H heads). All heads of a row read the same
selected latent rows, so each gathered tile [BLOCK_N, C + R] serves BLOCK_H heads through two
tensor-core dots (scores: q_latent . c + q_rope . r; output p @ c), with an online softmax over
the K slots. Slots of -1 (top-k padding, CUDA-graph padding rows) are masked. The grid is
(T, heads / BLOCK_H) and the loop K / BLOCK_N: fixed for a fixed batch, so decode graphs
capture it; prefill rows use the same kernel (each row gathers its own slots).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_core.kernels.triton.mla import latent_tile_step
from atom_core.kernels.triton.common import (
    check_dim, check_float, check_int, check_last_dim_contiguous, check_same_device, next_pow2,
)

LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["num_slots"])
def _sparse_mla_kernel(
    ql_ptr, qr_ptr, kv_ptr, slots_ptr, out_ptr, scale_log2e, num_slots,
    stride_qlt, stride_qlh, stride_qrt, stride_qrh, stride_kvb, stride_kvs, stride_st, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, LATENT: tl.constexpr, ROPE: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < NUM_HEADS
    offs_c = tl.arange(0, LATENT)
    offs_r = tl.arange(0, ROPE)
    ql = tl.load(ql_ptr + token * stride_qlt + offs_h[:, None] * stride_qlh + offs_c[None, :], mask=h_ok[:, None],
                 other=0.0)
    qr = tl.load(qr_ptr + token * stride_qrt + offs_h[:, None] * stride_qrh + offs_r[None, :], mask=h_ok[:, None],
                 other=0.0)
    if UPCAST:
        ql = ql.to(tl.float32)
        qr = qr.to(tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, LATENT], dtype=tl.float32)
    for start in range(0, num_slots, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        slot = tl.load(slots_ptr + token * stride_st + offs_n, mask=offs_n < num_slots, other=-1).to(tl.int64)
        n_ok = slot >= 0
        safe = tl.where(n_ok, slot, 0)
        rows = kv_ptr + (safe // KV_BLOCK_SIZE) * stride_kvb + (safe % KV_BLOCK_SIZE) * stride_kvs
        m_i, l_i, acc = latent_tile_step(ql, qr, rows, n_ok, n_ok[None, :], offs_c, offs_r, scale_log2e, m_i, l_i,
                                         acc, LATENT, UPCAST, DOT_PRECISION)
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + token * stride_ot + offs_h[:, None] * stride_oh + offs_c[None, :],
             o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])


_INTERPRETED = not isinstance(_sparse_mla_kernel, triton.runtime.jit.JITFunction)


def mla_sparse_attention(
    q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, scale: float,
    out: torch.Tensor | None = None, *, block_h: int | None = None, block_n: int = 64, num_warps: int = 4,
) -> torch.Tensor:
    """Same contract as kernels.dsa_ref.mla_sparse_attention (block_h / block_n / num_warps: tile overrides)."""
    for name, t, n in (("q_latent", q_latent, 3), ("q_rope", q_rope, 3), ("kv_cache", kv_cache, 4),
                       ("slots", slots, 2)):
        check_dim(name, t, n)
        check_last_dim_contiguous(name, t)
    for name, t in (("q_latent", q_latent), ("q_rope", q_rope), ("kv_cache", kv_cache)):
        check_float(name, t)
    check_int("slots", slots)
    num_tokens, num_heads, latent = q_latent.shape
    rope = q_rope.shape[2]
    if q_rope.shape[:2] != (num_tokens, num_heads) or slots.shape[0] != num_tokens:
        raise ValueError(f"q_rope {tuple(q_rope.shape)} and slots {tuple(slots.shape)} must have the {num_tokens} "
                         f"rows (and q_rope the {num_heads} heads) of q_latent")
    if kv_cache.shape[2] != 1 or kv_cache.shape[3] != latent + rope or kv_cache.stride(2) != latent + rope:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} must be [NB, BS, 1, {latent} + {rope}], rows contiguous")
    if latent != next_pow2(latent) or rope != next_pow2(rope) or min(latent, rope) < 16:
        raise ValueError(f"sparse MLA needs power-of-two latent and rope dims >= 16, got {latent} and {rope}")
    if q_latent.dtype != kv_cache.dtype or q_rope.dtype != kv_cache.dtype:
        raise ValueError(f"queries {q_latent.dtype}/{q_rope.dtype} must have the cache dtype {kv_cache.dtype}")
    if out is not None and (out.shape != q_latent.shape or out.dtype != q_latent.dtype or out.stride(-1) != 1):
        raise ValueError(f"out must be {tuple(q_latent.shape)} {q_latent.dtype} with a contiguous last dim")
    check_same_device(q_latent=q_latent, q_rope=q_rope, kv_cache=kv_cache, slots=slots)
    if out is None:
        out = torch.empty_like(q_latent)
    if num_tokens == 0:
        return out
    block_h = block_h or max(16, min(next_pow2(num_heads), 16))
    _sparse_mla_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        q_latent, q_rope, kv_cache, slots, out, scale * LOG2E, slots.shape[1],
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1), kv_cache.stride(0),
        kv_cache.stride(1), slots.stride(0), out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, LATENT=latent, ROPE=rope, KV_BLOCK_SIZE=kv_cache.shape[1], BLOCK_H=block_h,
        BLOCK_N=block_n, UPCAST=_INTERPRETED and q_latent.dtype != torch.float32,
        DOT_PRECISION="ieee" if q_latent.dtype == torch.float32 else None, num_warps=num_warps,
    )
    return out
