"""Fused MoE over block-FP8 expert weights (Triton): DeepSeek-V3 / Qwen3-*-FP8 experts, e4m3
weights with one float32 scale per 128x128 block, activations quantized per token per 128 columns.

Same pipeline and contracts as `kernels/triton/moe.py` (alignment by expert, GEMM1 with the
activation in its epilogue, GEMM2 weighting rows by their top-k weight, a float32 sum over the K
rows of each token), whose alignment, tile order and sum it reuses. Oracle:
`quant/fp8.fused_moe_fp8_block_ref` (same signature).

Layout (as `quant/fp8.Fp8BlockMoEMethod` loads it): w13 e4m3 [E, 2I, H] (gate rows, then up rows),
w13_scale float32 [E, 2I, ceil(H/G)], w2 e4m3 [E, H, I], w2_scale float32 [E, H, ceil(I/G)], G the
block's K size (128). The checkpoint's block scales [ceil(R/128), ceil(K/G)] are expanded to one
row per weight row at load, so a TP slice or a gate/up half of any row count places like the
weight rows; the kernels read a [BLOCK_N] vector of scales per K step. That costs 4 bytes per 128
weight bytes (3% more than per-block scales) and keeps every slicing rule of the loader.

Launches (static shapes, no host sync: CUDA-graph safe):
  1. hidden -> e4m3 [T, H] + scales [T, ceil(H/G)] (`kernels/triton/fp8.py`, the reference's bits).
  2. Alignment (moe_routing).
  3. GEMM1: per K step of BLOCK_K (a divisor of G, so a step lies in one scale group) one fp8 x fp8
     tl.dot into float32 (e4m3 products are exact in float32), then acc += dot * x_scale[row] *
     w_scale[col]: the scales are applied per 128 columns, so the MMA's own accumulation never
     spans more than one group (Hopper's FP8 MMA accumulates with fewer bits than float32; the
     per-group promotion keeps that error to one group). Epilogue: silu(gate) * up (or swigluoai)
     in float32, rounded once to hidden's dtype.
  4. The activation rows -> e4m3 + per-row-per-G scales (the same quantizer), as the reference
     quantizes the down projection's input.
  5. GEMM2: the same inner loop over I, times the row's top-k weight, stored at row t*K + k.
  6. Sum over top-k in float32 (moe.moe_sum).
The dot runs on e4m3 operands on NVIDIA GPUs (FP8_DOT); elsewhere they are widened first (to
bfloat16 on ROCm, exact for every e4m3 value; to float32 under Triton's CPU interpreter, whose
bf16 and fp8 dots are not usable).

GPU tests compare float32 cases against the widened dot: Hopper's e4m3 MMA accumulates with
fewer bits. Half the weight bytes of bf16 make it faster than the bf16 fused MoE (measured: see
docs/PERFORMANCE.md). Offline sm_90 code: fp8 mma.sync for BLOCK_M 16-32, wgmma from 64, no
spills at the default tiles.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from atom_core.kernels.fp8_ref import FP8_DTYPE
from atom_core.kernels.moe_ref import check_activation
from atom_core.kernels.triton.common import check_dim, check_float, check_same_device
from atom_core.kernels.triton.fp8 import dot_fp8, dot_mode, quantize_activations
from atom_core.kernels.triton.moe import moe_sum
from atom_core.kernels.triton.moe_common import (
    ACTIVATIONS, GemmTile, MoeConfig, activate, check_routing, gemm1_tile, gemm2_tile, grouped_launch_setup,
    grouped_tile, store_aligned_rows, store_weighted_rows,
)
from atom_core.kernels.triton.tiles import load_a_tile, load_w_tile


@triton.jit(do_not_specialize=["num_assignments", "num_m_blocks", "limit"])
def _gemm1_kernel(
    xq_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
    num_assignments, num_m_blocks, limit, stride_xt, stride_xst, stride_we, stride_wn, stride_wse, stride_wsn,
    stride_ot, INTER: tl.constexpr, HIDDEN: tl.constexpr, GROUP: tl.constexpr, TOP_K: tl.constexpr,
    ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_MODE: tl.constexpr,
):
    """act(xq[tokens] @ w13[e].T, dequantized per group) for BLOCK_M aligned rows x BLOCK_N columns of I."""
    pid_m, pid_n, past_end = grouped_tile(num_m_blocks, num_post_ptr, INTER, BLOCK_M, BLOCK_N, GROUP_M)
    if past_end:
        return
    rows, token, expert, cols, offs_n = gemm1_tile(pid_m, pid_n, sorted_ptr, expert_ids_ptr, num_assignments, INTER,
                                                   TOP_K, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = xq_ptr + token[:, None] * stride_xt + offs_k[None, :]
    as_ptrs = xs_ptr + token * stride_xst
    g_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + INTER * stride_wn
    gs_ptrs = ws_ptr + expert * stride_wse + offs_n * stride_wsn
    us_ptrs = gs_ptrs + INTER * stride_wsn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        grp = k0 // GROUP  # BLOCK_K divides GROUP: the step lies in one scale group
        a = load_a_tile(a_ptrs, k0, HIDDEN, BLOCK_K, HIDDEN % BLOCK_K != 0)
        wg = load_w_tile(g_ptrs, k0, HIDDEN, BLOCK_K, HIDDEN % BLOCK_K != 0)
        wu = load_w_tile(u_ptrs, k0, HIDDEN, BLOCK_K, HIDDEN % BLOCK_K != 0)
        sa = tl.load(as_ptrs + grp)
        acc_g += dot_fp8(a, wg, DOT_MODE) * (sa[:, None] * tl.load(gs_ptrs + grp)[None, :])
        acc_u += dot_fp8(a, wu, DOT_MODE) * (sa[:, None] * tl.load(us_ptrs + grp)[None, :])
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    act = activate(acc_g, acc_u, limit, ACTIVATION)
    store_aligned_rows(out_ptr, act, rows, cols, stride_ot, INTER)


@triton.jit(do_not_specialize=["num_assignments", "num_m_blocks"])
def _gemm2_kernel(
    aq_ptr, as_ptr, w_ptr, ws_ptr, topk_weights_ptr, out_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
    num_assignments, num_m_blocks, stride_at, stride_ast, stride_we, stride_wn, stride_wse, stride_wsn, stride_ot,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_MODE: tl.constexpr,
):
    """topk_weight * (actq[rows] @ w2[e].T, dequantized per group) for BLOCK_M aligned rows x
    BLOCK_N columns of H, stored at the rows' flat ids t*K + k."""
    pid_m, pid_n, past_end = grouped_tile(num_m_blocks, num_post_ptr, HIDDEN, BLOCK_M, BLOCK_N, GROUP_M)
    if past_end:
        return
    rows, flat, row_ok, expert, cols, offs_n = gemm2_tile(pid_m, pid_n, sorted_ptr, expert_ids_ptr, num_assignments,
                                                          HIDDEN, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = aq_ptr + rows.to(tl.int64)[:, None] * stride_at + offs_k[None, :]
    as_ptrs = as_ptr + rows.to(tl.int64) * stride_ast
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    ws_ptrs = ws_ptr + expert * stride_wse + offs_n * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        grp = k0 // GROUP
        a = load_a_tile(a_ptrs, k0, INTER, BLOCK_K, INTER % BLOCK_K != 0)
        w = load_w_tile(w_ptrs, k0, INTER, BLOCK_K, INTER % BLOCK_K != 0)
        acc += dot_fp8(a, w, DOT_MODE) * (tl.load(as_ptrs + grp)[:, None] * tl.load(ws_ptrs + grp)[None, :])
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    store_weighted_rows(out_ptr, acc, topk_weights_ptr, flat, row_ok, cols, stride_ot, HIDDEN)


def default_fp8_moe_config(num_tokens: int, top_k: int, num_experts: int, group_size: int) -> MoeConfig:
    """Tiles by the average rows per expert, BLOCK_K the scale group (at most 128). Untuned (no GPU
    when written): chosen from offline sm_90 compiles as the widest tiles of moe.py's tiers that
    compile without register spills (tests/quant/test_fp8_moe.py checks that)."""
    rows_per_expert = num_tokens * top_k / num_experts
    bk = min(128, group_size)
    if rows_per_expert <= 8:  # decode: weight-bandwidth bound; narrow N tiles for more programs
        return MoeConfig(16, GemmTile(32, bk, 1, 4, 4), GemmTile(64, bk, 1, 4, 4))
    if rows_per_expert <= 32:
        return MoeConfig(32, GemmTile(64, bk, 1, 4, 4), GemmTile(64, bk, 1, 4, 4))
    if rows_per_expert <= 128:
        return MoeConfig(64, GemmTile(64, bk, 4, 8, 3), GemmTile(128, bk, 4, 8, 4))
    return MoeConfig(128, GemmTile(64, bk, 8, 8, 3), GemmTile(128, bk, 8, 8, 3))


def _check_args(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, group_size, activation,
                swiglu_limit) -> None:
    check_activation(activation, swiglu_limit)
    check_dim("hidden", hidden, 2)
    check_float("hidden", hidden)
    if group_size < 16 or group_size & (group_size - 1):
        raise ValueError(f"block-FP8 group size must be a power of two >= 16, got {group_size}")
    num_tokens, hidden_size = hidden.shape
    for name, t in (("w13", w13), ("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
        check_dim(name, t, 3)
        if t.stride(2) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    groups = lambda k: -(-k // group_size)  # noqa: E731
    expect = {"w13": (num_experts, 2 * inter, hidden_size), "w13_scale": (num_experts, 2 * inter, groups(hidden_size)),
              "w2": (num_experts, hidden_size, inter), "w2_scale": (num_experts, hidden_size, groups(inter))}
    for name, t in (("w13", w13), ("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
        if tuple(t.shape) != expect[name]:
            raise ValueError(f"{name} must be {list(expect[name])} for H={hidden_size}, I={inter}, E={num_experts}, "
                             f"G={group_size}, got {tuple(t.shape)}")
    if w13.dtype != FP8_DTYPE or w2.dtype != FP8_DTYPE:
        raise ValueError(f"w13 and w2 must be float8_e4m3fn, got {w13.dtype} and {w2.dtype}")
    if w13_scale.dtype != torch.float32 or w2_scale.dtype != torch.float32:
        raise ValueError(f"w13_scale and w2_scale must be float32, got {w13_scale.dtype} and {w2_scale.dtype}")
    check_routing(topk_weights, topk_ids, num_tokens)
    if hidden.stride(1) != 1:
        raise ValueError(f"hidden must be contiguous in its last dim, got strides {hidden.stride()}")
    check_same_device(hidden=hidden, w13=w13, w13_scale=w13_scale, w2=w2, w2_scale=w2_scale,
                      topk_weights=topk_weights, topk_ids=topk_ids)


def fused_moe_fp8_block(
    hidden: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, group_size: int = 128, activation: str = "silu",
    swiglu_limit: Optional[float] = None, *, config: MoeConfig | None = None,
) -> torch.Tensor:
    """Same contract as `quant.fp8.fused_moe_fp8_block_ref`; six launches (module docstring).
    Precision: e4m3 products exact, summed in float32 per scale group, the group's partial sum
    times both scales added in float32; the activation in float32 rounded once to hidden's dtype
    and quantized per G columns; each weighted expert output rounded once, their sum in float32."""
    _check_args(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, group_size, activation, swiglu_limit)
    out = torch.empty_like(hidden)
    num_tokens, hidden_size = hidden.shape
    num_experts, inter, top_k = w13.shape[0], w13.shape[1] // 2, topk_ids.shape[1]
    if num_tokens == 0:
        return out
    cfg = config or default_fp8_moe_config(num_tokens, top_k, num_experts, group_size)
    sorted_ids, expert_ids, num_post, num_m, act = grouped_launch_setup(
        topk_ids, cfg, num_experts, group_size, inter, hidden, "block-FP8")
    mode = dot_mode(hidden.device)
    xq, xs = quantize_activations(hidden, group_size)
    t1 = cfg.gemm1
    _gemm1_kernel[(num_m * triton.cdiv(inter, t1.block_n),)](
        xq, xs, w13, w13_scale, act, sorted_ids, expert_ids, num_post, num_tokens * top_k, num_m,
        float(swiglu_limit or 0.0), xq.stride(0), xs.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0),
        w13_scale.stride(1), act.stride(0), INTER=inter, HIDDEN=hidden_size, GROUP=group_size, TOP_K=top_k,
        ACTIVATION=ACTIVATIONS[activation], BLOCK_M=cfg.block_m, BLOCK_N=t1.block_n, BLOCK_K=t1.block_k,
        GROUP_M=t1.group_m, DOT_MODE=mode, num_warps=t1.num_warps, num_stages=t1.num_stages,
    )
    aq, a_scale = quantize_activations(act, group_size)
    partial = hidden.new_empty((num_tokens * top_k, hidden_size))
    t2 = cfg.gemm2
    _gemm2_kernel[(num_m * triton.cdiv(hidden_size, t2.block_n),)](
        aq, a_scale, w2, w2_scale, topk_weights, partial, sorted_ids, expert_ids, num_post, num_tokens * top_k,
        num_m, aq.stride(0), a_scale.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1),
        partial.stride(0), HIDDEN=hidden_size, INTER=inter, GROUP=group_size, BLOCK_M=cfg.block_m,
        BLOCK_N=t2.block_n, BLOCK_K=t2.block_k, GROUP_M=t2.group_m, DOT_MODE=mode, num_warps=t2.num_warps,
        num_stages=t2.num_stages,
    )
    return moe_sum(partial, topk_ids, num_experts, out)
