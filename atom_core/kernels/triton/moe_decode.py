"""bf16/fp16/fp32 fused MoE for decode (few (token, slot) assignments): two GEMV kernels, no tl.dot,
no alignment launch, no sum launch. `moe.launch_fused_moe` dispatches here (`select_path`).

Why: at batch 1 the tiled path (moe.py) pads each expert's one row to a BLOCK_M = 16 tile and adds
the alignment and sum launches, so a layer takes well over its bytes' time (measured on
Qwen3-30B-A3B and DeepSeek-V2-Lite: see docs/PERFORMANCE.md). The MXFP4 family replaced the same
pattern with GEMVs (moe_mxfp4_decode.py, faster than its tiled path at M = 1); these are their
bf16 siblings, with the layout of the MXFP4 ones and the tiles of its sweep as the starting point:

- GEMM1 `_moe_gemv1_kernel`: program (row block rb, assignment a = t*K + k): BLOCK_N gate rows and the
  same BLOCK_N up rows of expert topk_ids[a] over all of H, the bias and the activation (moe_common.activate:
  silu, or swigluoai with its clamp) in the epilogue, rounded once to hidden's dtype into act [T*K, I].
  The grid puts the assignments of one row block next to each other, so assignments sharing an
  expert read the same bytes at about the same time (the repeats can come from L2).
- GEMM2 `_moe_gemv2_kernel`: program (row block rb, token t): BLOCK_N rows of H for all K of t's experts
  at once (a [BLOCK_N, K, BLOCK_K] tile, num_warps = K: with BLOCK_K = 32 threads x 8 values a warp
  owns one slot), times the routing weight, summed over k in registers in a fixed order.

Both inner loops keep a [rows, BLOCK_K] float32 accumulator (an FMA per weight, no cross-thread sum
until the end) and load the next BLOCK_K columns before multiplying the current ones (a register
double buffer, as the MXFP4 GEMVs do). Rows past I or H are clamped onto the last row (no masks on
the row dim) and never stored.

Skipped, reading no bytes: an assignment whose id is outside [0, E) (dropped) or whose routing weight
is 0. Under expert parallelism FusedMoE maps other ranks' experts to local expert 0 with weight 0;
the tiled path reads expert 0 for them (once, whatever their count), here they cost nothing. The
result is the same as computing them (0 * a finite output), unless an expert output overflows.

Precision: float32 accumulation, the activation in float32 rounded once to hidden's dtype (as the
tiled path and the reference do), the weighted sum over k in float32, rounded once. Deterministic.

The kernels' names start with `_moe_` so that a profile of CUDA-graph replays files them under MoE
(profiling/module_types.py matches kernel names) and tells them from the MXFP4 GEMVs.

`select_path`'s `auto` gives decode batches these GEMVs and everything else the tiled path;
`python -m benchmarks.kernels.moe_decode_bench` measures both (path="gemv" / "tiled").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch
import triton
import triton.language as tl

from atom_core.kernels.triton.moe_common import ACTIVATIONS, MoeConfig, activate

# T * top_k up to this may run the GEMVs (the MXFP4 GEMVs' measured bound: past it, experts repeat
# across tokens and the tiled path, which reads each expert once, won on gpt-oss-20b).
GEMV_MAX_ASSIGNMENTS = 32
# and T up to this (bf16: the GEMVs beat the tiled path at 1-2 tokens on Qwen3-30B-A3B,
# DeepSeek-V2-Lite, Mixtral and gpt-oss-20b shapes, tie or lose from 4; see docs/PERFORMANCE.md).
GEMV_MAX_TOKENS = 2
MoePath = Literal["auto", "gemv", "tiled"]
MOE_PATHS = ("auto", "gemv", "tiled")


@dataclass(frozen=True)
class GemvTiles:
    """gemv1: (BLOCK_N gate rows and as many up rows, BLOCK_K, num_warps); gemv2: (BLOCK_N, BLOCK_K),
    num_warps = next_pow2(top_k). Untuned defaults: a thread
    loads 16 bytes (8 bf16) of a row a step; sizes from offline sm_90 compiles at the four model shapes
    of the tests: the MXFP4 GEMVs' winners (8 rows, gemv1 on one warp) took ~166 registers here and
    spilled (gemv1 at Mixtral's shape, gemv2 at gpt-oss's); gemv1 on 2 warps and gemv2 with 4 rows take
    66-96 and spill nothing."""

    gemv1: tuple[int, int, int] = (8, 128, 2)
    gemv2: tuple[int, int] = (4, 256)


DEFAULT_TILES = GemvTiles()
FP32_TILES = GemvTiles((8, 64, 2), (4, 128))  # 4-byte values: the same bytes a row, the same registers

def select_path(num_tokens: int, top_k: int, config: MoeConfig | None = None, path: MoePath = "auto") -> str:
    """'gemv' or 'tiled'. An explicit path wins (tests, benchmarks); `auto` gives decode-sized batches
    (T <= GEMV_MAX_TOKENS and T * top_k <= GEMV_MAX_ASSIGNMENTS, no tile config given) the GEMVs,
    everything else the tiled path."""
    if path not in MOE_PATHS:
        raise ValueError(f"unknown MoE path {path!r}; expected one of: {', '.join(MOE_PATHS)}")
    if path != "auto":
        return path
    if config is not None or num_tokens > GEMV_MAX_TOKENS or num_tokens * top_k > GEMV_MAX_ASSIGNMENTS:
        return "tiled"
    return "gemv"


@triton.jit(do_not_specialize=["num_assignments", "num_experts", "limit"])
def _moe_gemv1_kernel(
    x_ptr, w_ptr, bias_ptr, ids_ptr, topk_weights_ptr, act_ptr, num_assignments, num_experts, limit,
    stride_xt, stride_we, stride_wn, stride_be, stride_at,
    INTER: tl.constexpr, HIDDEN: tl.constexpr, TOP_K: tl.constexpr, ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """act[a, n] = act(x[t] @ w13[e].T + b13[e])[n] for BLOCK_N columns n of I, a = t*K + k, e = topk_ids[a]."""
    pid = tl.program_id(0)
    a = pid % num_assignments
    rb = pid // num_assignments
    expert = tl.load(ids_ptr + a)
    if (expert < 0) | (expert >= num_experts) | (tl.load(topk_weights_ptr + a) == 0.0):
        return
    expert = expert.to(tl.int64)
    token = (a // TOP_K).to(tl.int64)
    rows = tl.minimum(rb * BLOCK_N + tl.arange(0, BLOCK_N), INTER - 1)  # past I: never stored
    offs_k = tl.arange(0, BLOCK_K)[None, :]
    g_ptrs = w_ptr + expert * stride_we + (rows[:, None] * stride_wn + offs_k)  # int32 within an expert
    u_ptrs = g_ptrs + INTER * stride_wn
    # x loads as [BLOCK_N, BLOCK_K] (each row the same addresses, L1 hits) so that it gets the weights'
    # layout: a [BLOCK_K] or [1, BLOCK_K] x was converted to it through shared memory every step.
    x_ptrs = x_ptr + token * stride_xt + (offs_k + rows[:, None] * 0)
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    ok = offs_k < HIDDEN
    wg = tl.load(g_ptrs, mask=ok, other=0.0)
    wu = tl.load(u_ptrs, mask=ok, other=0.0)
    for k0 in range(0, HIDDEN, BLOCK_K):
        next_ok = offs_k < HIDDEN - BLOCK_K - k0  # the next columns' bytes fly while these multiply
        wg_next = tl.load(g_ptrs + BLOCK_K, mask=next_ok, other=0.0)
        wu_next = tl.load(u_ptrs + BLOCK_K, mask=next_ok, other=0.0)
        x = tl.load(x_ptrs, mask=ok, other=0.0).to(tl.float32)
        acc_g += wg.to(tl.float32) * x
        acc_u += wu.to(tl.float32) * x
        wg, wu, ok = wg_next, wu_next, next_ok
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    gate = tl.sum(acc_g, axis=1)
    up = tl.sum(acc_u, axis=1)
    cols = rb * BLOCK_N + tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        gate += tl.load(bias_ptr + expert * stride_be + rows).to(tl.float32)
        up += tl.load(bias_ptr + expert * stride_be + INTER + rows).to(tl.float32)
    act = activate(gate, up, limit, ACTIVATION)
    tl.store(act_ptr + a.to(tl.int64) * stride_at + cols, act.to(act_ptr.dtype.element_ty), mask=cols < INTER)


@triton.jit(do_not_specialize=["num_tokens", "num_experts"])
def _moe_gemv2_kernel(
    act_ptr, w_ptr, bias_ptr, topk_weights_ptr, ids_ptr, out_ptr, num_tokens, num_experts,
    stride_at, stride_we, stride_wn, stride_be, stride_ot,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, K_P: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[t, n] = sum_k topk_weight[t, k] * (act[t*K + k] @ w2[e_k].T + b2[e_k])[n] for BLOCK_N
    columns n of H, summed over k in a fixed order in float32."""
    pid = tl.program_id(0)
    token = pid % num_tokens
    rb = pid // num_tokens
    offs_k = tl.arange(0, K_P)
    flat = token * TOP_K + offs_k
    slot_ok = offs_k < TOP_K
    expert = tl.load(ids_ptr + flat, mask=slot_ok, other=-1)
    weight = tl.load(topk_weights_ptr + flat, mask=slot_ok, other=0.0)
    k_ok = slot_ok & (expert >= 0) & (expert < num_experts) & (weight != 0.0)  # the slots GEMM1 wrote
    expert = tl.where(k_ok, expert, 0).to(tl.int64)
    cols = rb * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(cols, HIDDEN - 1)
    offs_i = tl.arange(0, BLOCK_K)[None, None, :]
    k_ok3 = k_ok[None, :, None]
    # [rows, k, columns of I]
    w_ptrs = w_ptr + expert[None, :, None] * stride_we + (rows[:, None, None] * stride_wn + offs_i)
    a_ptrs = act_ptr + flat.to(tl.int64)[None, :, None] * stride_at + offs_i
    acc = tl.zeros([BLOCK_N, K_P, BLOCK_K], dtype=tl.float32)
    ok = k_ok3 & (offs_i < INTER)
    w = tl.load(w_ptrs, mask=ok, other=0.0)
    for i0 in range(0, INTER, BLOCK_K):
        next_ok = k_ok3 & (offs_i < INTER - BLOCK_K - i0)
        w_next = tl.load(w_ptrs + BLOCK_K, mask=next_ok, other=0.0)
        acc += w.to(tl.float32) * tl.load(a_ptrs, mask=ok, other=0.0).to(tl.float32)
        w, ok = w_next, next_ok
        w_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    y = tl.sum(acc, axis=2)  # [BLOCK_N, K_P]
    if HAS_BIAS:
        y += tl.load(bias_ptr + expert[None, :] * stride_be + rows[:, None], mask=k_ok[None, :], other=0.0).to(
            tl.float32)
    y = tl.where(k_ok[None, :], y * weight[None, :], 0.0)
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + cols, tl.sum(y, axis=1).to(out_ptr.dtype.element_ty),
             mask=cols < HIDDEN)


def default_tiles(dtype: torch.dtype) -> GemvTiles:
    return FP32_TILES if dtype == torch.float32 else DEFAULT_TILES


def fused_moe_gemv(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    activation: str, w13_bias: Optional[torch.Tensor], w2_bias: Optional[torch.Tensor],
    swiglu_limit: Optional[float], out: torch.Tensor, tiles: GemvTiles | None = None,
) -> torch.Tensor:
    """Shapes as `moe_ref.fused_moe`, already checked by `moe.launch_fused_moe` (`_check_moe_args`). Two launches, grids
    from host ints only, no host sync (CUDA-graph safe)."""
    num_tokens, hidden_size = hidden.shape
    num_experts, inter, top_k = w13.shape[0], w13.shape[1] // 2, topk_ids.shape[1]
    num_assignments = num_tokens * top_k
    tiles = tiles or default_tiles(hidden.dtype)
    (bn1, bk1, warps1), (bn2, bk2) = tiles.gemv1, tiles.gemv2
    act = hidden.new_empty((num_assignments, inter))
    _moe_gemv1_kernel[(num_assignments * triton.cdiv(inter, bn1),)](
        hidden, w13, w13_bias if w13_bias is not None else hidden, topk_ids, topk_weights, act, num_assignments,
        num_experts, float(swiglu_limit or 0.0), hidden.stride(0), w13.stride(0), w13.stride(1),
        w13_bias.stride(0) if w13_bias is not None else 0, act.stride(0),
        INTER=inter, HIDDEN=hidden_size, TOP_K=top_k, ACTIVATION=ACTIVATIONS[activation],
        HAS_BIAS=w13_bias is not None, BLOCK_N=bn1, BLOCK_K=bk1, num_warps=warps1, num_stages=1,
    )
    k_p = triton.next_power_of_2(top_k)
    _moe_gemv2_kernel[(num_tokens * triton.cdiv(hidden_size, bn2),)](
        act, w2, w2_bias if w2_bias is not None else hidden, topk_weights, topk_ids, out, num_tokens, num_experts,
        act.stride(0), w2.stride(0), w2.stride(1), w2_bias.stride(0) if w2_bias is not None else 0, out.stride(0),
        HIDDEN=hidden_size, INTER=inter, TOP_K=top_k, K_P=k_p, HAS_BIAS=w2_bias is not None, BLOCK_N=bn2,
        BLOCK_K=bk2, num_warps=k_p, num_stages=1,
    )
    return out
