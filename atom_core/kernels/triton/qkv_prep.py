"""QKV projection output -> (q-norm, k-norm) -> RoPE -> K/V into the cache, one launch (Triton).

Separately these are up to five launches per layer (q norm, k norm, rotary, a copy of v, the
KV store); at batch 1 each costs more in launch gap than in work. One program per token reads
the token's q, k and v heads once. Arithmetic follows the unfused kernels step by step,
rounding to the model dtype where they round, so results match them bit for bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_core.kernels.triton.common import (
    LaunchPlans, PlannedLaunch, check_dim, check_float, check_int, check_last_dim_contiguous, check_same_device,
    next_pow2,
)
from atom_core.kernels.triton.kv_store import (
    check_kv_caches, check_token_scales, scale_kernel_args, to_cache, token_head_scale,
)
from atom_core.kernels.triton.rotary import token_cos_sin


@triton.jit
def norm_rope(src, stride_h, w_ptr, eps, cos, sin,
              NH: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, REST: tl.constexpr,
              BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
              HAS_NORM: tl.constexpr):
    """Heads [NH, HEAD_DIM] at src -> rotated halves (x1, x2) and the unrotated rest, in the
    input dtype: RMSNorm (fp32, rounded, times weight, rounded), then neox RoPE in fp32."""
    dtype = src.dtype.element_ty
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_i = tl.arange(0, BLOCK_HALF)[None, :]
    offs_r = tl.arange(0, BLOCK_REST)[None, :]
    half_mask = (offs_h < NH) & (offs_i < HALF)
    rest_mask = (offs_h < NH) & (offs_r < REST)
    row = src + offs_h * stride_h
    x1 = tl.load(row + offs_i, mask=half_mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF + offs_i, mask=half_mask, other=0.0).to(tl.float32)
    rest = tl.load(row + 2 * HALF + offs_r, mask=rest_mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        sq = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1) + tl.sum(rest * rest, 1)
        inv = tl.math.rsqrt(sq / HEAD_DIM + eps)[:, None]
        w1 = tl.load(w_ptr + offs_i, mask=offs_i < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs_i, mask=offs_i < HALF, other=0.0).to(tl.float32)
        wr = tl.load(w_ptr + 2 * HALF + offs_r, mask=offs_r < REST, other=0.0).to(tl.float32)
        x1 = ((x1 * inv).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * inv).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
        rest = ((rest * inv).to(dtype).to(tl.float32) * wr)
    o1 = (x1 * cos - x2 * sin).to(dtype)
    o2 = (x2 * cos + x1 * sin).to(dtype)
    return o1, o2, rest.to(dtype)


@triton.jit
def _store_scales(dst, stride_h, scale, NH: tl.constexpr, BLOCK_H: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    tl.store(dst + offs_h * stride_h, scale, mask=offs_h < NH)


@triton.jit
def store_heads(dst, stride_h, o1, o2, rest, NH: tl.constexpr, HALF: tl.constexpr, REST: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
                inv_scale=1.0, FP8_MAX: tl.constexpr = 0.0):
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_i = tl.arange(0, BLOCK_HALF)[None, :]
    offs_r = tl.arange(0, BLOCK_REST)[None, :]
    half_mask = (offs_h < NH) & (offs_i < HALF)
    row = dst + offs_h * stride_h
    ty = dst.dtype.element_ty
    tl.store(row + offs_i, to_cache(o1, inv_scale, FP8_MAX).to(ty), mask=half_mask)
    tl.store(row + HALF + offs_i, to_cache(o2, inv_scale, FP8_MAX).to(ty), mask=half_mask)
    tl.store(row + 2 * HALF + offs_r, to_cache(rest, inv_scale, FP8_MAX).to(ty), mask=(offs_h < NH) & (offs_r < REST))


@triton.jit
def _qkv_rope_store_kernel(
    qkv_ptr, positions_ptr, cos_sin_ptr, q_norm_ptr, k_norm_ptr, q_out_ptr,
    k_cache_ptr, v_cache_ptr, slot_mapping_ptr, eps, block_size,
    stride_t, stride_cs, stride_qo_t, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr, REST: tl.constexpr, HAS_NORM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
    BLOCK_D: tl.constexpr, k_inv_scale=1.0, v_inv_scale=1.0, FP8_MAX: tl.constexpr = 0.0,
    k_scales_ptr=None, v_scales_ptr=None, stride_sb=0, stride_ss=0, stride_sh=0, TOKEN_SCALES: tl.constexpr = False,
):
    token, cos, sin = token_cos_sin(positions_ptr, cos_sin_ptr, stride_cs, HALF, BLOCK_HALF)
    q_src = qkv_ptr + token * stride_t
    k_src = q_src + NUM_HEADS * HEAD_DIM
    v_src = k_src + NUM_KV_HEADS * HEAD_DIM

    o1, o2, rest = norm_rope(q_src, HEAD_DIM, q_norm_ptr, eps, cos, sin, NUM_HEADS, HEAD_DIM, HALF, REST,
                              BLOCK_H, BLOCK_HALF, BLOCK_REST, HAS_NORM)
    store_heads(q_out_ptr + token * stride_qo_t, HEAD_DIM, o1, o2, rest, NUM_HEADS, HALF, REST,
                 BLOCK_H, BLOCK_HALF, BLOCK_REST)

    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padded token of a CUDA-graph batch: it owns no slot
        return
    block, offset = slot // block_size, slot % block_size
    o1, o2, rest = norm_rope(k_src, HEAD_DIM, k_norm_ptr, eps, cos, sin, NUM_KV_HEADS, HEAD_DIM, HALF, REST,
                              BLOCK_KH, BLOCK_HALF, BLOCK_REST, HAS_NORM)
    offs_h = tl.arange(0, BLOCK_KH)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < NUM_KV_HEADS) & (offs_d < HEAD_DIM)
    v = tl.load(v_src + offs_h * HEAD_DIM + offs_d, mask=mask, other=0.0)
    if TOKEN_SCALES:  # each kv head's row by its own scale (padding lanes hold 0: they do not raise amax)
        k_amax = tl.maximum(tl.maximum(tl.max(tl.abs(o1.to(tl.float32)), 1), tl.max(tl.abs(o2.to(tl.float32)), 1)),
                            tl.max(tl.abs(rest.to(tl.float32)), 1))
        k_scale, k_inv = token_head_scale(k_amax, FP8_MAX)
        v_scale, v_inv = token_head_scale(tl.max(tl.abs(v.to(tl.float32)), 1), FP8_MAX)
        scale_offset = block * stride_sb + offset * stride_ss
        _store_scales(k_scales_ptr + scale_offset, stride_sh, k_scale, NUM_KV_HEADS, BLOCK_KH)
        _store_scales(v_scales_ptr + scale_offset, stride_sh, v_scale, NUM_KV_HEADS, BLOCK_KH)
        k_inv_row = k_inv[:, None]
        v_inv_row = v_inv[:, None]
    else:
        k_inv_row = k_inv_scale
        v_inv_row = v_inv_scale
    store_heads(k_cache_ptr + block * stride_kcb + offset * stride_kcs, stride_kch, o1, o2, rest,
                 NUM_KV_HEADS, HALF, REST, BLOCK_KH, BLOCK_HALF, BLOCK_REST, k_inv_row, FP8_MAX)
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + offs_h * stride_vch + offs_d
    tl.store(v_dst, to_cache(v, v_inv_row, FP8_MAX).to(v_cache_ptr.dtype.element_ty), mask=mask)


def qkv_rope_store(
    qkv: torch.Tensor,  # [T, (H + 2 * KH) * D]
    positions: torch.Tensor,  # [T] int
    cos_sin_cache: torch.Tensor,  # [max_pos, rot_dim] float32
    k_cache: torch.Tensor,  # [NB, BS, KH, D]
    v_cache: torch.Tensor,  # [NB, BS, KH, D]
    slot_mapping: torch.Tensor,  # [T] int; < 0 means skip (padding)
    num_heads: int,
    q_norm_weight: torch.Tensor | None = None,  # [D]
    k_norm_weight: torch.Tensor | None = None,  # [D]
    eps: float = 1e-6,
    k_scale: float | torch.Tensor = 1.0,  # FP8 caches: K / k_scale and V / v_scale are stored, or
    v_scale: float | torch.Tensor = 1.0,  # [NB, BS, KH] float32 per-token-head scales, written here
    direct_launch: bool = True,  # False: through Triton's JIT call path every time (PlannedLaunch)
) -> torch.Tensor:
    """Same contract as `torch_ref.qkv_rope_store`: returns q [T, H, D]; K/V go to the cache."""
    has_norm = q_norm_weight is not None
    # positions is a fresh view per layer under piecewise graphs, and each layer may own its rotary
    # cache: those two by layout (all the checks read), the step's slot mapping by identity.
    key = (positions.shape, positions.dtype, positions.device, cos_sin_cache.shape, cos_sin_cache.stride(),
           cos_sin_cache.dtype, cos_sin_cache.device, id(slot_mapping), qkv.shape, qkv.stride(), qkv.dtype, qkv.device,
           k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.device, v_cache.shape, v_cache.stride(),
           v_cache.dtype, v_cache.device, num_heads, eps, k_norm_weight is None,
           q_norm_weight.shape if has_norm else None, k_norm_weight.shape if k_norm_weight is not None else None,
           k_scale if not isinstance(k_scale, torch.Tensor) else id(k_scale),
           v_scale if not isinstance(v_scale, torch.Tensor) else id(v_scale))
    plan = _PLANS.get_or_make(key, lambda: _qkv_plan(qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                                                     num_heads, q_norm_weight, k_norm_weight, k_scale, v_scale))
    num_tokens, head_dim, layout, kwargs, kernel = plan[1:]
    q_out = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q_out
    weights = (q_norm_weight, k_norm_weight) if has_norm else (q_out, q_out)  # unused without norm
    k_scales, v_scales = (k_scale, v_scale) if isinstance(k_scale, torch.Tensor) else (None, None)
    kernel((qkv, positions, cos_sin_cache, weights[0], weights[1], q_out, k_cache, v_cache, k_scales, v_scales),
           lambda: ((qkv, positions, cos_sin_cache, weights[0], weights[1], q_out,
                     k_cache, v_cache, slot_mapping, eps, k_cache.shape[1],
                     qkv.stride(0), cos_sin_cache.stride(0), q_out.stride(0), *layout),
                    dict(kwargs, num_warps=4)), direct_launch)
    return q_out


_PLANS = LaunchPlans()  # qkv_rope_store's, by its inputs' layouts: the layers of one step share one
_MAX_PLANS = LaunchPlans.MAX_SIZE


def _qkv_plan(qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, num_heads, q_norm_weight,
              k_norm_weight, k_scale, v_scale) -> tuple:
    """Validate the inputs and fix what the launch needs besides the per-layer tensors."""
    check_dim("qkv", qkv, 2)
    check_float("qkv", qkv)
    check_last_dim_contiguous("qkv", qkv)
    check_kv_caches(k_cache, v_cache)
    check_int("positions", positions)
    check_int("slot_mapping", slot_mapping)
    check_dim("cos_sin_cache", cos_sin_cache, 2)
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.stride(-1) != 1:
        raise ValueError(f"cos_sin_cache must be float32 with a contiguous last dim, got {cos_sin_cache.dtype}")
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if k_cache.shape != v_cache.shape or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not hold {num_heads} q heads plus 2 x {num_kv_heads} "
                         f"kv heads of the caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if positions.shape != (num_tokens,) or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"positions {tuple(positions.shape)} and slot_mapping {tuple(slot_mapping.shape)} "
                         f"must be [{num_tokens}]")
    rot_dim = cos_sin_cache.shape[1]
    if rot_dim % 2 or rot_dim > head_dim:
        raise ValueError(f"rot_dim {rot_dim} must be even and <= head_dim {head_dim}")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight go together")
    has_norm = q_norm_weight is not None
    if has_norm and (q_norm_weight.shape != (head_dim,) or k_norm_weight.shape != (head_dim,)):
        raise ValueError(f"q/k norm weights must be [{head_dim}], got {tuple(q_norm_weight.shape)} "
                         f"and {tuple(k_norm_weight.shape)}")
    check_same_device(qkv=qkv, positions=positions, cos_sin_cache=cos_sin_cache, k_cache=k_cache,
                      v_cache=v_cache, slot_mapping=slot_mapping)
    token_scales = check_token_scales(k_cache, k_scale, v_scale)
    half, rest = rot_dim // 2, head_dim - rot_dim
    layout = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
              v_cache.stride(2))
    kwargs = dict(NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
                  HALF=half, REST=rest, HAS_NORM=has_norm,
                  BLOCK_H=next_pow2(num_heads), BLOCK_KH=next_pow2(num_kv_heads), BLOCK_HALF=next_pow2(half),
                  BLOCK_REST=max(1, next_pow2(rest)), BLOCK_D=next_pow2(head_dim),
                  **scale_kernel_args(k_cache, k_scale, v_scale, token_scales))
    # The layers' launches: only their tensors (qkv, rotary cache, norms, caches, q_out) differ.
    kernel = PlannedLaunch(_qkv_rope_store_kernel, (num_tokens,), _QKV_PER_CALL)
    return (slot_mapping, k_scale, v_scale), num_tokens, head_dim, layout, kwargs, kernel


_QKV_PER_CALL = ("qkv_ptr", "positions_ptr", "cos_sin_ptr", "q_norm_ptr", "k_norm_ptr", "q_out_ptr", "k_cache_ptr",
                 "v_cache_ptr", "k_scales_ptr", "v_scales_ptr")

