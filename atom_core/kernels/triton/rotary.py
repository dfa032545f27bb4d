"""Neox-style rotary embedding, applied in place to q and k (Triton)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_core.kernels.triton.common import (
    check_dim, check_float, check_int, check_last_dim_contiguous, check_same_device, next_pow2,
)


@triton.jit
def _rotate_heads(x_ptr, stride_h, cos, sin, NUM_HEADS: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """x[:, :HALF], x[:, HALF:2*HALF] <- x1*cos - x2*sin, x2*cos + x1*sin (fp32 math)."""
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_i = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (offs_h < NUM_HEADS) & (offs_i < HALF)
    ptr1 = x_ptr + offs_h * stride_h + offs_i
    ptr2 = ptr1 + HALF
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr2, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptr2, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def token_cos_sin(positions_ptr, cos_sin_ptr, stride_cs, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """A one-token-per-program kernel's token (int64) and the cos and sin of its position,
    [1, BLOCK_HALF] float32 each, 0 past HALF."""
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_i = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_i, mask=offs_i < HALF, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_i, mask=offs_i < HALF, other=0.0)
    return token, cos, sin


@triton.jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, cos_sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token, cos, sin = token_cos_sin(positions_ptr, cos_sin_ptr, stride_cs, HALF, BLOCK_HALF)
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, cos, sin, NUM_HEADS, HALF, BLOCK_H, BLOCK_HALF)
    _rotate_heads(k_ptr + token * stride_kt, stride_kh, cos, sin, NUM_KV_HEADS, HALF, BLOCK_KH, BLOCK_HALF)


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary embedding on the first rot_dim dims of each head (shapes as `torch_ref.rotary_embedding`).

    Rotates query and key IN PLACE (they may be strided views of a fused qkv buffer) and
    returns them; dims past rot_dim are untouched.
    """
    check_int("positions", positions)
    check_dim("cos_sin_cache", cos_sin_cache, 2)
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.stride(-1) != 1:
        raise ValueError(f"cos_sin_cache must be float32 with a contiguous last dim, got {cos_sin_cache.dtype}")
    for name, t in (("query", query), ("key", key)):
        check_dim(name, t, 3)
        check_float(name, t)
        check_last_dim_contiguous(name, t)
    num_tokens, num_heads, head_dim = query.shape
    rot_dim = cos_sin_cache.shape[1]
    if key.shape[0] != num_tokens or key.shape[2] != head_dim or positions.shape != (num_tokens,):
        raise ValueError(f"positions {tuple(positions.shape)}, query {tuple(query.shape)} and key "
                         f"{tuple(key.shape)} disagree on [T] or head_dim")
    if rot_dim % 2 or rot_dim > head_dim:
        raise ValueError(f"rot_dim {rot_dim} must be even and <= head_dim {head_dim}")
    check_same_device(positions=positions, query=query, key=key, cos_sin_cache=cos_sin_cache)
    if num_tokens == 0:
        return query, key
    num_kv_heads, half = key.shape[1], rot_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions, query, key, cos_sin_cache,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos_sin_cache.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half,
        BLOCK_H=next_pow2(num_heads), BLOCK_KH=next_pow2(num_kv_heads), BLOCK_HALF=next_pow2(half),
        num_warps=4,
    )
    return query, key
