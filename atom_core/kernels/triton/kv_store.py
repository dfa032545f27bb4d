"""Write this step's K/V rows into the paged cache (Triton)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_core.kernels.triton.common import (
    check_dim, check_float, check_int, check_last_dim_contiguous, check_same_device, next_pow2,
)


@triton.jit
def _store_kv_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, block_size,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padded token of a CUDA-graph batch: it owns no slot
        return
    block, offset = slot // block_size, slot % block_size
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < NUM_KV_HEADS) & (offs_d < HEAD_DIM)
    src = token.to(tl.int64)
    k = tl.load(key_ptr + src * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
    v = tl.load(value_ptr + src * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + offs_h * stride_kch + offs_d
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + offs_h * stride_vch + offs_d
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_cache(
    key: torch.Tensor,  # [T, KH, D]
    value: torch.Tensor,  # [T, KH, D]
    k_cache: torch.Tensor,  # [NB, BS, KH, D]
    v_cache: torch.Tensor,  # [NB, BS, KH, D]
    slot_mapping: torch.Tensor,  # [T] int; slot = block * BS + offset; < 0 means skip (padding)
) -> None:
    """Write each token's K and V into its cache slot, in place; slots < 0 are skipped.

    key/value may be strided views (e.g. slices of a fused qkv output) as long as the last
    dim is contiguous. Values are cast to the cache dtype.
    """
    for name, t in (("key", key), ("value", value)):
        check_dim(name, t, 3)
        check_float(name, t)
        check_last_dim_contiguous(name, t)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_dim(name, t, 4)
        check_float(name, t)
        check_last_dim_contiguous(name, t)
    check_int("slot_mapping", slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or k_cache.shape != v_cache.shape or k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"key {tuple(key.shape)} / value {tuple(value.shape)} do not fit caches "
                         f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)} ([NB, BS, KH, D])")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if num_tokens == 0:
        return
    _store_kv_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, k_cache.shape[1],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=next_pow2(num_kv_heads), BLOCK_D=next_pow2(head_dim),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
