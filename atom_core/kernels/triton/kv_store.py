"""Write this step's K/V rows into the paged cache (Triton).

An FP8 cache stores K / k_scale and V / v_scale with per-layer float scales, or with
per-token-head scale tensors (--kv-cache-dtype fp8_per_token_head) each (token, kv head) row
by its own scale amax / FP8 max, written beside the codes; the arithmetic is
torch_ref.quantize_per_token_head's (IEEE float32 division), so codes and scales match its bits.
The fused store in qkv_prep.py shares these helpers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_core.kernels.torch_ref import FP8_KV_DTYPES
from atom_core.kernels.triton.common import (
    check_dim, check_float, check_int, check_last_dim_contiguous, check_same_device, next_pow2,
)


@triton.jit
def token_head_scale(row_amax, FP8_MAX: tl.constexpr):
    """Per-row amax -> (scale, 1 / scale), both by IEEE division (div.rn); 0 and 0 for an all-zero row."""
    scale = tl.math.div_rn(row_amax, FP8_MAX)
    inv = tl.where(scale > 0, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), 0.0)
    return scale, inv


@triton.jit
def to_cache(x, inv_scale, FP8_MAX: tl.constexpr):
    """A value in its cache element type: FP8 (FP8_MAX > 0) holds x * inv_scale in float32,
    saturated, rounded to nearest even (torch_ref.to_kv_cache); otherwise a plain cast."""
    if FP8_MAX > 0:
        x = tl.clamp(x.to(tl.float32) * inv_scale, -FP8_MAX, FP8_MAX)
    return x


@triton.jit
def _store_rows(x, cache_dst, scale_dst, stride_sh, inv_scale, offs_h, mask,
                NUM_KV_HEADS: tl.constexpr, FP8_MAX: tl.constexpr, TOKEN_SCALES: tl.constexpr):
    """x [BLOCK_H, BLOCK_D] (masked lanes 0) into the cache rows at cache_dst; with TOKEN_SCALES
    each row's own scale goes to scale_dst + head * stride_sh."""
    if TOKEN_SCALES:
        scale, inv = token_head_scale(tl.max(tl.abs(x.to(tl.float32)), 1), FP8_MAX)
        tl.store(scale_dst + offs_h * stride_sh, scale, mask=offs_h < NUM_KV_HEADS)
        inv_scale = inv[:, None]
    tl.store(cache_dst, to_cache(x, inv_scale, FP8_MAX).to(cache_dst.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, block_size,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    k_inv_scale=1.0, v_inv_scale=1.0, FP8_MAX: tl.constexpr = 0.0,
    k_scales_ptr=None, v_scales_ptr=None, stride_sb=0, stride_ss=0, stride_sh=0, TOKEN_SCALES: tl.constexpr = False,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padded token of a CUDA-graph batch: it owns no slot
        return
    block, offset = slot // block_size, slot % block_size
    offs_h = tl.arange(0, BLOCK_H)
    rows = offs_h[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (rows < NUM_KV_HEADS) & (offs_d < HEAD_DIM)
    src = token.to(tl.int64)
    k = tl.load(key_ptr + src * stride_kt + rows * stride_kh + offs_d, mask=mask, other=0.0)
    v = tl.load(value_ptr + src * stride_vt + rows * stride_vh + offs_d, mask=mask, other=0.0)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + rows * stride_kch + offs_d
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + rows * stride_vch + offs_d
    if TOKEN_SCALES:
        k_scale_dst = k_scales_ptr + block * stride_sb + offset * stride_ss
        v_scale_dst = v_scales_ptr + block * stride_sb + offset * stride_ss
    else:
        k_scale_dst = k_cache_ptr  # unused
        v_scale_dst = v_cache_ptr
    _store_rows(k, k_dst, k_scale_dst, stride_sh, k_inv_scale, offs_h, mask, NUM_KV_HEADS, FP8_MAX, TOKEN_SCALES)
    _store_rows(v, v_dst, v_scale_dst, stride_sh, v_inv_scale, offs_h, mask, NUM_KV_HEADS, FP8_MAX, TOKEN_SCALES)


def check_kv_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """k_cache and v_cache [NB, BS, KH, D], float or FP8, contiguous in D: what every kernel that
    writes the paged cache needs of them (their shapes against the inputs are the caller's check)."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_dim(name, t, 4)
        if t.dtype not in FP8_KV_DTYPES:
            check_float(name, t)
        check_last_dim_contiguous(name, t)


def check_token_scales(k_cache: torch.Tensor, k_scale, v_scale) -> bool:
    """True for per-token-head scales (float32 [NB, BS, KH] tensors with one stride set beside an
    FP8 cache), False for per-layer floats; ValueError for anything else."""
    if not isinstance(k_scale, torch.Tensor) and not isinstance(v_scale, torch.Tensor):
        return False
    if not (isinstance(k_scale, torch.Tensor) and isinstance(v_scale, torch.Tensor)):
        raise ValueError("k_scale and v_scale must both be floats or both per-token-head tensors")
    if k_cache.dtype not in FP8_KV_DTYPES:
        raise ValueError(f"per-token-head scales need an FP8 cache, got {k_cache.dtype}")
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t.shape != k_cache.shape[:3] or t.dtype != torch.float32 or t.stride() != k_scale.stride():
            raise ValueError(f"{name} must be float32 {tuple(k_cache.shape[:3])} ([NB, BS, KH], the strides of "
                             f"k_scale), got {t.dtype} {tuple(t.shape)} strides {t.stride()}")
    check_same_device(k_cache=k_cache, k_scale=k_scale, v_scale=v_scale)
    return True


def scale_kernel_args(k_cache: torch.Tensor, k_scale, v_scale, token_scales: bool) -> dict:
    """The scale arguments the store and attention kernels share: per-layer scales as floats
    (1.0 where they are the scale tensors), the scale tensors and their strides, and FP8_MAX."""
    args = {"FP8_MAX": float(torch.finfo(k_cache.dtype).max) if k_cache.dtype in FP8_KV_DTYPES else 0.0}
    if not token_scales:
        return {**args, "k_inv_scale": 1.0 / k_scale, "v_inv_scale": 1.0 / v_scale}
    return {**args, "k_inv_scale": 1.0, "v_inv_scale": 1.0, "k_scales_ptr": k_scale, "v_scales_ptr": v_scale,
            "stride_sb": k_scale.stride(0), "stride_ss": k_scale.stride(1), "stride_sh": k_scale.stride(2),
            "TOKEN_SCALES": True}


def store_kv_cache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0,
) -> None:
    """Write each token's K and V into its cache slot, in place; slots < 0 are skipped.
    Same contract as `torch_ref.store_kv_cache`.

    key/value may be strided views (e.g. slices of a fused qkv output) as long as the last
    dim is contiguous. Values are cast to the cache dtype (FP8: scaled, saturated, rounded).
    """
    for name, t in (("key", key), ("value", value)):
        check_dim(name, t, 3)
        check_float(name, t)
        check_last_dim_contiguous(name, t)
    check_kv_caches(k_cache, v_cache)
    check_int("slot_mapping", slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or k_cache.shape != v_cache.shape or k_cache.shape[2:] != key.shape[1:] \
            or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"key {tuple(key.shape)} / value {tuple(value.shape)} do not fit caches "
                         f"{tuple(k_cache.shape)} {k_cache.dtype} / {tuple(v_cache.shape)} {v_cache.dtype} "
                         f"([NB, BS, KH, D], one dtype)")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    token_scales = check_token_scales(k_cache, k_scale, v_scale)
    if num_tokens == 0:
        return
    _store_kv_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, k_cache.shape[1],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=next_pow2(num_kv_heads), BLOCK_D=next_pow2(head_dim),
        **scale_kernel_args(k_cache, k_scale, v_scale, token_scales),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
