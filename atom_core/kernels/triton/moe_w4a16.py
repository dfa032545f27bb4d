"""Fused MoE over W4A16 expert weights (Triton): int4 experts in the canonical layout of
`quant/int_ops.py`, stacked per expert, dequantized in the GEMMs' inner loop (the weight crosses
HBM as 4 bits plus a scale per group), activations in bf16/fp16/fp32.

Layout: w13 int32 [E, 2I, H/8] (gate rows then up rows; element k of a row is nibble k % 8 of
word k // 8, an unsigned u in [0, 15]), w13_scale [E, 2I, H/G] in the activation dtype, w13_zero
uint8 [E, 2I, H/G] or None (symmetric: zero 8); w2 [E, H, I/8], w2_scale [E, H, I/G], w2_zero.
W = (u - zero) * scale, as `int_ops.dequantize_int4` computes it. Oracle:
`quant/int4_moe.fused_moe_w4a16_ref` (same signature).

Same pipeline as `kernels/triton/moe.py` (alignment, GEMM1 with the activation in its epilogue,
GEMM2 weighted by top-k, a float32 sum), whose alignment, tile order and sum it reuses. Per K
step of BLOCK_K (a divisor of G, so one scale and zero per column) the [BLOCK_N, BLOCK_K/8] words
are unpacked by shifts, (u - zero) * scale is formed in float32 and rounded once to the
activation dtype (the reference's rounding), and one tl.dot accumulates in float32.

Used by `quant/int4_moe.CompressedTensorsW4A16MoEMethod` on CUDA (llm-compressor W4A16 MoE
checkpoints). Its tiles are untuned: it runs slower than the bf16 fused MoE despite a quarter of
the weight bytes, far above its bytes floor (measured: see docs/PERFORMANCE.md).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from atom_core.kernels.moe_ref import check_activation
from atom_core.kernels.triton.common import check_dim, check_float, check_same_device
from atom_core.kernels.triton.moe import moe_sum
from atom_core.kernels.triton.moe_common import (
    ACTIVATIONS, GemmTile, MoeConfig, activate, check_routing, dot_args, gemm1_tile, gemm2_tile,
    grouped_launch_setup, grouped_tile, store_aligned_rows, store_weighted_rows,
)


@triton.jit
def _dequant_tile(w_ptrs, s_ptrs, z_ptrs, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                  HAS_ZERO: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """Words [BLOCK_N, BLOCK_K/8] at w_ptrs (K offset k0) -> weights [BLOCK_K, BLOCK_N] in OUT_DTYPE."""
    offs_w = tl.arange(0, BLOCK_K // 8)
    words = tl.load(w_ptrs, mask=(k0 + offs_w * 8 < K)[None, :], other=0)
    nib = (words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF  # [BLOCK_N, BLOCK_K/8, 8]
    u = tl.reshape(nib, (BLOCK_N, BLOCK_K)).to(tl.float32)
    scale = tl.load(s_ptrs).to(tl.float32)
    if HAS_ZERO:
        zero = tl.load(z_ptrs).to(tl.float32)
    else:
        zero = tl.full([BLOCK_N], 8.0, tl.float32)
    return tl.trans(((u - zero[:, None]) * scale[:, None]).to(OUT_DTYPE))


@triton.jit
def _dot(a, w, DOT_IN_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    if DOT_IN_FP32:
        a, w = a.to(tl.float32), w.to(tl.float32)
    return tl.dot(a, w, input_precision=DOT_PRECISION)


@triton.jit(do_not_specialize=["num_assignments", "num_m_blocks", "limit"])
def _gemm1_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
    num_assignments, num_m_blocks, limit, stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_ot,
    INTER: tl.constexpr, HIDDEN: tl.constexpr, GROUP: tl.constexpr, TOP_K: tl.constexpr, ACTIVATION: tl.constexpr,
    HAS_ZERO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_IN_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """act(x[tokens] @ w13[e].T) for BLOCK_M aligned rows x BLOCK_N columns of I (zeros share the scales' strides)."""
    pid_m, pid_n, past_end = grouped_tile(num_m_blocks, num_post_ptr, INTER, BLOCK_M, BLOCK_N, GROUP_M)
    if past_end:
        return
    rows, token, expert, cols, offs_n = gemm1_tile(pid_m, pid_n, sorted_ptr, expert_ids_ptr, num_assignments, INTER,
                                                   TOP_K, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :]
    g_ptrs = w_ptr + expert * stride_we + offs_n[:, None] * stride_wn + tl.arange(0, BLOCK_K // 8)[None, :]
    u_ptrs = g_ptrs + INTER * stride_wn
    gs_off = expert * stride_se + offs_n * stride_sn
    us_off = gs_off + INTER * stride_sn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        grp = k0 // GROUP  # BLOCK_K divides GROUP
        a = tl.load(a_ptrs, mask=(k0 + offs_k < HIDDEN)[None, :], other=0.0)
        wg = _dequant_tile(g_ptrs, s_ptr + gs_off + grp, z_ptr + gs_off + grp, k0, HIDDEN, BLOCK_K, BLOCK_N,
                           HAS_ZERO, a.dtype)
        wu = _dequant_tile(u_ptrs, s_ptr + us_off + grp, z_ptr + us_off + grp, k0, HIDDEN, BLOCK_K, BLOCK_N,
                           HAS_ZERO, a.dtype)
        acc_g += _dot(a, wg, DOT_IN_FP32, DOT_PRECISION)
        acc_u += _dot(a, wu, DOT_IN_FP32, DOT_PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K // 8
        u_ptrs += BLOCK_K // 8
    act = activate(acc_g, acc_u, limit, ACTIVATION)
    store_aligned_rows(out_ptr, act, rows, cols, stride_ot, INTER)


@triton.jit(do_not_specialize=["num_assignments", "num_m_blocks"])
def _gemm2_kernel(
    a_ptr, w_ptr, s_ptr, z_ptr, topk_weights_ptr, out_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
    num_assignments, num_m_blocks, stride_at, stride_we, stride_wn, stride_se, stride_sn, stride_ot,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """topk_weight * (act[rows] @ w2[e].T) for BLOCK_M aligned rows x BLOCK_N columns of H, at rows t*K + k."""
    pid_m, pid_n, past_end = grouped_tile(num_m_blocks, num_post_ptr, HIDDEN, BLOCK_M, BLOCK_N, GROUP_M)
    if past_end:
        return
    rows, flat, row_ok, expert, cols, offs_n = gemm2_tile(pid_m, pid_n, sorted_ptr, expert_ids_ptr, num_assignments,
                                                          HIDDEN, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_at + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[:, None] * stride_wn + tl.arange(0, BLOCK_K // 8)[None, :]
    s_off = expert * stride_se + offs_n * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        grp = k0 // GROUP
        a = tl.load(a_ptrs, mask=(k0 + offs_k < INTER)[None, :], other=0.0)
        w = _dequant_tile(w_ptrs, s_ptr + s_off + grp, z_ptr + s_off + grp, k0, INTER, BLOCK_K, BLOCK_N, HAS_ZERO,
                          a.dtype)
        acc += _dot(a, w, DOT_IN_FP32, DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // 8
    store_weighted_rows(out_ptr, acc, topk_weights_ptr, flat, row_ok, cols, stride_ot, HIDDEN)


def default_w4a16_moe_config(num_tokens: int, top_k: int, num_experts: int, group_size: int) -> MoeConfig:
    """Tiles by the average rows per expert, BLOCK_K the group (at most 128). Untuned (no GPU when written)."""
    rows_per_expert = num_tokens * top_k / num_experts
    bk = min(128, group_size)
    if rows_per_expert <= 8:
        return MoeConfig(16, GemmTile(32, bk, 1, 4, 3), GemmTile(64, bk, 1, 4, 3))
    if rows_per_expert <= 32:
        return MoeConfig(32, GemmTile(64, bk, 1, 4, 3), GemmTile(64, bk, 1, 4, 3))
    if rows_per_expert <= 128:
        return MoeConfig(64, GemmTile(64, bk, 4, 4, 3), GemmTile(128, bk, 4, 8, 3))
    # GEMM1 holds two accumulators: BLOCK_K 128 spilled at this tile (offline sm_90 compile), 64 does not
    return MoeConfig(128, GemmTile(64, min(64, bk), 8, 8, 3), GemmTile(128, bk, 8, 8, 3))


def _check_args(hidden, w13, w13_scale, w13_zero, w2, w2_scale, w2_zero, topk_weights, topk_ids, group_size,
                activation, swiglu_limit) -> None:
    check_activation(activation, swiglu_limit)
    check_dim("hidden", hidden, 2)
    check_float("hidden", hidden)
    num_tokens, hidden_size = hidden.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    if group_size < 16 or group_size & (group_size - 1) or hidden_size % group_size or inter % group_size:
        raise ValueError(f"W4A16 MoE needs a power-of-two group size >= 16 dividing H={hidden_size} and "
                         f"I={inter}, got {group_size}")
    expect = {"w13": (num_experts, 2 * inter, hidden_size // 8), "w2": (num_experts, hidden_size, inter // 8),
              "w13_scale": (num_experts, 2 * inter, hidden_size // group_size),
              "w2_scale": (num_experts, hidden_size, inter // group_size)}
    named = {"w13": w13, "w2": w2, "w13_scale": w13_scale, "w2_scale": w2_scale}
    if w13_zero is not None or w2_zero is not None:
        if w13_zero is None or w2_zero is None:
            raise ValueError("give both w13_zero and w2_zero, or neither (symmetric)")
        expect.update(w13_zero=expect["w13_scale"], w2_zero=expect["w2_scale"])
        named.update(w13_zero=w13_zero, w2_zero=w2_zero)
    for name, t in named.items():
        if tuple(t.shape) != expect[name] or t.stride(2) != 1:
            raise ValueError(f"{name} must be {list(expect[name])}, contiguous in its last dim, for H={hidden_size}, "
                             f"I={inter}, E={num_experts}, G={group_size}, got {tuple(t.shape)}")
    if w13.dtype != torch.int32 or w2.dtype != torch.int32:
        raise ValueError(f"w13 and w2 must be int32 words of 8 int4 values, got {w13.dtype} and {w2.dtype}")
    if w13_scale.dtype != hidden.dtype or w2_scale.dtype != hidden.dtype:
        raise ValueError(f"scales must have hidden's dtype {hidden.dtype}, got {w13_scale.dtype} and {w2_scale.dtype}")
    if w13_zero is not None and (w13_zero.dtype != torch.uint8 or w2_zero.dtype != torch.uint8):
        raise ValueError(f"zero points must be uint8, got {w13_zero.dtype} and {w2_zero.dtype}")
    if w13_zero is not None and (w13_zero.stride() != w13_scale.stride() or w2_zero.stride() != w2_scale.stride()):
        raise ValueError("zero points must have their scales' strides")
    check_routing(topk_weights, topk_ids, num_tokens)
    if hidden.stride(1) != 1:
        raise ValueError(f"hidden must be contiguous in its last dim, got strides {hidden.stride()}")
    check_same_device(hidden=hidden, w13=w13, w2=w2, topk_ids=topk_ids, **{k: v for k, v in named.items() if "_" in k})


def fused_moe_w4a16(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H/8] int32
    w13_scale: torch.Tensor,  # [E, 2I, H/G] hidden's dtype
    w13_zero: Optional[torch.Tensor],  # [E, 2I, H/G] uint8, or None (zero 8)
    w2: torch.Tensor,  # [E, H, I/8] int32
    w2_scale: torch.Tensor,  # [E, H, I/G]
    w2_zero: Optional[torch.Tensor],  # [E, H, I/G] uint8, or None
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int32
    group_size: int = 128,
    activation: str = "silu",
    swiglu_limit: Optional[float] = None,
    *,
    config: MoeConfig | None = None,
) -> torch.Tensor:
    """Same contract as `quant.int4_moe.fused_moe_w4a16_ref`; four or five launches, no host sync.
    Precision: each dequantized weight rounded once to hidden's dtype (as the reference's), float32
    accumulation, the activation in float32 rounded once, each weighted expert output rounded once,
    their sum in float32."""
    _check_args(hidden, w13, w13_scale, w13_zero, w2, w2_scale, w2_zero, topk_weights, topk_ids, group_size,
                activation, swiglu_limit)
    out = torch.empty_like(hidden)
    num_tokens, hidden_size = hidden.shape
    num_experts, inter, top_k = w13.shape[0], w13.shape[1] // 2, topk_ids.shape[1]
    if num_tokens == 0:
        return out
    cfg = config or default_w4a16_moe_config(num_tokens, top_k, num_experts, group_size)
    sorted_ids, expert_ids, num_post, num_m, act = grouped_launch_setup(
        topk_ids, cfg, num_experts, group_size, inter, hidden, "W4A16")
    t1, has_zero = cfg.gemm1, w13_zero is not None
    _gemm1_kernel[(num_m * triton.cdiv(inter, t1.block_n),)](
        hidden, w13, w13_scale, w13_zero if has_zero else w13_scale, act, sorted_ids, expert_ids, num_post,
        num_tokens * top_k, num_m, float(swiglu_limit or 0.0), hidden.stride(0), w13.stride(0), w13.stride(1),
        w13_scale.stride(0), w13_scale.stride(1), act.stride(0), INTER=inter, HIDDEN=hidden_size, GROUP=group_size,
        TOP_K=top_k, ACTIVATION=ACTIVATIONS[activation], HAS_ZERO=has_zero, BLOCK_M=cfg.block_m,
        BLOCK_N=t1.block_n, BLOCK_K=t1.block_k, GROUP_M=t1.group_m, num_warps=t1.num_warps,
        num_stages=t1.num_stages, **dot_args(hidden.dtype),
    )
    partial = hidden.new_empty((num_tokens * top_k, hidden_size))
    t2 = cfg.gemm2
    _gemm2_kernel[(num_m * triton.cdiv(hidden_size, t2.block_n),)](
        act, w2, w2_scale, w2_zero if has_zero else w2_scale, topk_weights, partial, sorted_ids, expert_ids,
        num_post, num_tokens * top_k, num_m, act.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0),
        w2_scale.stride(1), partial.stride(0), HIDDEN=hidden_size, INTER=inter, GROUP=group_size, HAS_ZERO=has_zero,
        BLOCK_M=cfg.block_m, BLOCK_N=t2.block_n, BLOCK_K=t2.block_k, GROUP_M=t2.group_m, num_warps=t2.num_warps,
        num_stages=t2.num_stages, **dot_args(hidden.dtype),
    )
    return moe_sum(partial, topk_ids, num_experts, out)
