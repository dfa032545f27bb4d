"""Weight-only FP8 GEMV for decode (M <= 4 rows, Triton): y [M, N] = x [M, K] @ dequant(W)^T (+ bias),
W e4m3 [N, K], x in bf16/fp16/fp32 and NOT quantized (W8A16, as Marlin-FP8 does):

  fp8_channel_gemv(x, weight, weight_scale, bias)             per-tensor [1] / per-channel [N] or [N, 1]
  fp8_block_gemv(x, weight, weight_scale_inv, block_size, bias)  block FP8: scales [ceil(N/bn), ceil(K/bk)],
      row-expanded ([N, ceil(K/bk)], bn = 1, as the loader keeps them) or compact (bn = 128)
  fp8_gemv_ref(x, weight, scale, block_size, bias)             the torch reference of both

Why: at batch 1 a linear is a weight stream. The tl.dot GEMM (fp8_gemm.py) pads the one row to a
BLOCK_M 16 MMA and quantizes x; cuBLAS `_scaled_mm` runs well above the weight-bytes floor at one
row (its tiles are built for many) plus a quantizer launch per linear. Here each program streams
BLOCK_N rows of W once for all M rows of x, in registers, like the bf16 MoE GEMVs (moe_decode.py).

Precision (more accurate than fp8_linear_ref / fp8_block_linear_ref, which quantize x to e4m3):
each weight becomes float32 exactly, times its block scale (block layout) or not (per channel:
the scale multiplies each row's sum at the end), times x in float32, summed in float32 (a fixed
order: deterministic), bias added in float32, rounded once to x's dtype. The reference dequantizes
W to float32 and multiplies in float32; results differ by float32 summation order only.

Layout: a program owns BLOCK_N rows; per K step it loads a [BLOCK_N, BLOCK_K] weight tile and each x
row as a tile of the same shape (the row broadcast over BLOCK_N by the pointers, so it gets the
weights' register layout; ptxas merges the equal-address loads, one x load serves a thread's rows)
and keeps a [BLOCK_N, BLOCK_K] float32 accumulator per x row (an FMA per weight and row; one
cross-thread sum at the end). Weights load VEC = 16 / x's element size at a time (8 bytes for half
x): with 16-byte weight loads Triton gave the weights another layout than x's 8-a-thread and moved
every tile through shared memory (offline TTGIR). The next step's weights load before the current
ones are used (a register double buffer; the last step re-reads its own tile, so no mask). Rows past
N are clamped onto row N - 1 and never stored; columns past K are masked.

Block scales (`_fp8_block_gemv_kernel`, a sibling with the same grid, split-K and epilogue): the tile
is [BLOCK_N, C, VEC], a thread's VEC columns (a chunk) lie in one scale group, so a step sums w * x
over the chunk in registers and multiplies the sum by the chunk's scale, and the next step's scales
load with its weights. Offline sm_90 SASS (bf16 x, 1 token, Qwen3-30B-A3B's qkv and o, default
tiles, instructions in the K loop per weight): per channel 5.94; block before 7.19 (a float32
multiply per weight, and its 4 scale loads a step consumed in the step that issued them: a memory
round trip in every step, where the weights' double buffer hides it; the likely cause of its
slowness), after 6.91 (12 float ops per 8 weights instead of 16, scales one step ahead, 72
registers, no spills). Both paths spend ~3 instructions a weight unpacking e4m3 (the loop carries
the prefetched bytes one a register and re-pairs them for the e4m3x2 conversion): the next lever.

Split-K (grid axis 1) when the grid's bytes in flight are too few to hide DRAM latency: a step of
the whole grid reads N * BLOCK_K bytes, split when that is under IN_FLIGHT_BYTES_PER_SM per SM. Each
split owns a run of whole K steps and stores float32 partials [SPLIT, M, N]; fp8_gemm's
`_sum_splits_kernel` adds them in split order (deterministic), adds the bias and rounds once.

Levers if the benchmark shows M = 1 far from the floor: tiles (a tile sweep); the
split's second launch (a last-arriving-split sum would save it); at M = 4 the instruction issue
(~10 a weight) and x's L1 traffic (2 bytes per weight and row) may bind before DRAM does.

Where it runs: at 1 token the per-channel kernel runs close to the bytes floor on Llama-3-8B's
shapes, well ahead of `_scaled_mm` with its activation quantizer, so fp8_ops dispatches 1-token
per-channel linears here (fp8_ops.fp8_linear_table). The block kernel (chunk scales, prefetched)
beats the Triton block GEMM at 1 token on all but one measured shape (Llama-3-8B's down, K =
14,336, where the GEMM's longer K loop amortizes its tile), so the table takes it at 1 token too
(measured: see docs/PERFORMANCE.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from atom_core.kernels.fp8_ref import GEMV_MAX_TOKENS, dequantize_fp8_block
from atom_core.kernels.triton.common import sm_count
from atom_core.kernels.triton.fp8_gemm import channel_scales, check_operands, split_k_target, sum_splits
from atom_core.kernels.triton.tiles import store_gemv_row, store_gemv_rows

MAX_SPLIT_K = 8


@dataclass(frozen=True)
class Fp8GemvConfig:
    block_n: int  # weight rows a program streams
    block_k: int  # columns a step; a power of two >= 16 (16 e4m3 = one 16-byte load a thread)
    num_warps: int
    split_k: int  # K splits (grid axis 1); 1 = the GEMV stores the output itself


@triton.jit
def _fma_row(acc, w, x_ptrs, k_ok, MASK_K: tl.constexpr):
    """acc [BN, BK] += w [BN, BK] (float32) * one x row loaded in w's layout."""
    if MASK_K:
        x = tl.load(x_ptrs, mask=k_ok, other=0.0)
    else:
        x = tl.load(x_ptrs)
    return acc + w * x.to(tl.float32)


@triton.jit
def _load_w(w_ptrs, k_ok, MASK_K: tl.constexpr):
    if MASK_K:
        return tl.load(w_ptrs, mask=k_ok, other=0.0)
    return tl.load(w_ptrs)


@triton.jit(do_not_specialize=["steps_per_split"])
def _fp8_gemv_kernel(
    x_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, steps_per_split,
    stride_xm, stride_wn, stride_wsn, stride_om, stride_os,
    M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr, IS_SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
):
    """out[m, cols] (or split partials) for BLOCK_N columns, all M (<= 4) rows of x, one split's K steps.
    Per-tensor / per-channel weights: the scale of row r is ws_ptr + r * stride_wsn (stride 0: one scale)."""
    split = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(cols, N - 1)  # weight rows; past N: never stored
    offs_k = tl.arange(0, BLOCK_K)[None, :]
    MASK_K: tl.constexpr = K % BLOCK_K != 0
    k_start = split * steps_per_split * BLOCK_K
    k_end = tl.minimum(k_start + steps_per_split * BLOCK_K, K)
    # weights load VEC (16 bytes of x) at a time, so their register layout is x's: with 16-byte weight
    # loads (16 e4m3) the compiler moved every weight tile through shared memory to x's 8 a thread
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + (k_start + tl.max_contiguous(offs_k, [1, VEC]))
    x_ptrs = x_ptr + (k_start + offs_k + rows[:, None] * 0)  # x rows in the weights' layout (repeats: L1)
    acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    w = _load_w(w_ptrs, offs_k < K - k_start, MASK_K)
    for k0 in range(k_start, k_end, BLOCK_K):
        # the next columns' bytes fly while these multiply; the last step re-reads its own tile (no mask)
        step = tl.where(k0 + BLOCK_K < k_end, BLOCK_K, 0)
        w_next = _load_w(w_ptrs + step, offs_k < K - k0 - step, MASK_K)
        wf = w.to(tl.float32)
        k_ok = offs_k < K - k0
        acc0 = _fma_row(acc0, wf, x_ptrs, k_ok, MASK_K)
        if M > 1:
            acc1 = _fma_row(acc1, wf, x_ptrs + stride_xm, k_ok, MASK_K)
        if M > 2:
            acc2 = _fma_row(acc2, wf, x_ptrs + 2 * stride_xm, k_ok, MASK_K)
        if M > 3:
            acc3 = _fma_row(acc3, wf, x_ptrs + 3 * stride_xm, k_ok, MASK_K)
        w = w_next
        w_ptrs += step
        x_ptrs += BLOCK_K
    w_scale = tl.load(ws_ptr + rows * stride_wsn)  # per channel / tensor: times the row sums
    out_ptrs = out_ptr + split * stride_os + cols
    col_ok = cols < N
    store_gemv_row(tl.sum(acc0, axis=1) * w_scale, bias_ptr, out_ptrs, rows, col_ok, HAS_BIAS, IS_SPLIT)
    if M > 1:
        store_gemv_row(tl.sum(acc1, axis=1) * w_scale, bias_ptr, out_ptrs + stride_om, rows, col_ok, HAS_BIAS,
                   IS_SPLIT)
    if M > 2:
        store_gemv_row(tl.sum(acc2, axis=1) * w_scale, bias_ptr, out_ptrs + 2 * stride_om, rows, col_ok, HAS_BIAS,
                   IS_SPLIT)
    if M > 3:
        store_gemv_row(tl.sum(acc3, axis=1) * w_scale, bias_ptr, out_ptrs + 3 * stride_om, rows, col_ok, HAS_BIAS,
                   IS_SPLIT)


@triton.jit
def _chunk_sums(w, x_ptrs, k_ok, MASK_K: tl.constexpr):
    """[BN, C] float32: per weight row and VEC-column chunk, sum(w * x) over the chunk. A chunk is
    one thread's VEC columns, so the sum stays in registers (no shuffle)."""
    if MASK_K:
        x = tl.load(x_ptrs, mask=k_ok, other=0.0)
    else:
        x = tl.load(x_ptrs)
    return tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=2)


@triton.jit
def _group_scales(s_ptrs, k0, chunk_k, stride_wsk, GROUP: tl.constexpr, LAST_GROUP: tl.constexpr):
    """[BN, C] block scales of the chunks starting at columns k0 + chunk_k; chunks past K take the
    last group's (finite) scale and multiply zeros."""
    return tl.load(s_ptrs + tl.minimum((k0 + chunk_k) // GROUP, LAST_GROUP) * stride_wsk)


@triton.jit(do_not_specialize=["steps_per_split"])
def _fp8_block_gemv_kernel(
    x_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, steps_per_split,
    stride_xm, stride_wn, stride_wsn, stride_wsk, stride_om, stride_os,
    M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, SCALE_BN: tl.constexpr, GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr, IS_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    VEC: tl.constexpr, WIDE_ROWS: tl.constexpr,
):
    """The block-FP8 sibling of _fp8_gemv_kernel (same grid, split-K and epilogue). The tile is
    [BLOCK_N, C, VEC] (C = BLOCK_K / VEC chunks, one chunk a thread, VEC dividing GROUP): each chunk
    lies in one scale group, so a step sums w * x over a chunk in registers and multiplies that sum
    by the chunk's scale, a scale per VEC weights instead of one per weight. Scales of row r, group
    g: ws_ptr + (r // SCALE_BN) * stride_wsn + g * stride_wsk. The next step's scales load with its
    weights: a scale loaded and used in the same step puts a memory round trip in every step, one
    the weights' double buffer hides but a same-step scale load does not."""
    split = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(cols, N - 1)  # weight rows; past N: never stored
    CHUNKS: tl.constexpr = BLOCK_K // VEC
    chunk_k = tl.arange(0, CHUNKS)[None, :] * VEC  # [1, C]: a chunk's first column within the step
    offs_k = chunk_k[:, :, None] + tl.arange(0, VEC)[None, None, :]  # [1, C, VEC]
    MASK_K: tl.constexpr = K % BLOCK_K != 0
    LAST_GROUP: tl.constexpr = (K - 1) // GROUP
    k_start = split * steps_per_split * BLOCK_K
    k_end = tl.minimum(k_start + steps_per_split * BLOCK_K, K)
    rows3 = rows[:, None, None]
    if WIDE_ROWS:  # int32 offsets save registers (a spill at 1 token otherwise); int64 past 2^31 bytes
        rows3 = rows3.to(tl.int64)
    w_ptrs = w_ptr + rows3 * stride_wn + (k_start + tl.max_contiguous(offs_k, [1, 1, VEC]))
    x_ptrs = x_ptr + (k_start + offs_k + rows3 * 0)  # x rows in the weights' layout (repeats: L1)
    s_ptrs = ws_ptr + (rows // SCALE_BN)[:, None] * stride_wsn  # [BN, 1]
    acc0 = tl.zeros([BLOCK_N, CHUNKS], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, CHUNKS], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, CHUNKS], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, CHUNKS], dtype=tl.float32)
    w = _load_w(w_ptrs, offs_k < K - k_start, MASK_K)
    s = _group_scales(s_ptrs, k_start, chunk_k, stride_wsk, GROUP, LAST_GROUP)
    for k0 in range(k_start, k_end, BLOCK_K):
        step = tl.where(k0 + BLOCK_K < k_end, BLOCK_K, 0)  # the last step re-reads its own tile (no mask)
        w_next = _load_w(w_ptrs + step, offs_k < K - k0 - step, MASK_K)
        s_next = _group_scales(s_ptrs, k0 + step, chunk_k, stride_wsk, GROUP, LAST_GROUP)
        k_ok = offs_k < K - k0
        acc0 += _chunk_sums(w, x_ptrs, k_ok, MASK_K) * s
        if M > 1:
            acc1 += _chunk_sums(w, x_ptrs + stride_xm, k_ok, MASK_K) * s
        if M > 2:
            acc2 += _chunk_sums(w, x_ptrs + 2 * stride_xm, k_ok, MASK_K) * s
        if M > 3:
            acc3 += _chunk_sums(w, x_ptrs + 3 * stride_xm, k_ok, MASK_K) * s
        w = w_next
        s = s_next
        w_ptrs += step
        x_ptrs += BLOCK_K
    store_gemv_rows(acc0, acc1, acc2, acc3, bias_ptr, out_ptr + split * stride_os, stride_om, cols, rows, N, M,
                    HAS_BIAS, IS_SPLIT)


# ---------------------------------------------------------------------------------------------
# host side

# Split K until about this many weight bytes per SM are in flight: a step's loads (N * BLOCK_K bytes
# over the whole grid) are what hides DRAM latency (Little's law: bandwidth x latency / SMs; HBM3's
# ~3 TB/s x ~0.6 microseconds / sm_90's 132 SMs ~ 14 KB an SM). Llama-3-8B's narrowest projections
# (N 4096, BLOCK_K 512) pass without a split.
IN_FLIGHT_BYTES_PER_SM = 12 * 1024


def _pow2_divisor(n: int, cap: int) -> int:
    return min(n & -n, cap)


def default_fp8_gemv_config(m: int, n: int, k: int, x_bytes: int, group: int | None, num_sms: int,
                            w_bytes: int = 1) -> Fp8GemvConfig:
    """Chosen from offline sm_90 compiles (72-142 registers, no spills); `group` (the block scales'
    bk, None per channel) no longer changes the tile: any step suits any group. A tile sweep found
    no tile better on every shape than these (see docs/PERFORMANCE.md): 16 bytes of x a thread
    load (VEC columns), BLOCK_K 512 (256 for float32 x), 32 weights a thread a step at M <= 2 and 16 at M 3-4 (the accumulators
    grow with M), 4 warps; split-K per IN_FLIGHT_BYTES_PER_SM (w_bytes: a weight's size, 2 for
    the bf16 GEMV of dense_gemv.py)."""
    bk = max(16, min(256 if x_bytes == 4 else 512, triton.next_power_of_2(k)))
    per_thread = 32 if m <= 2 else 16
    warps = 4
    bn = max(1, per_thread * 32 * warps // bk)
    return Fp8GemvConfig(bn, bk, warps, split_for_bytes_in_flight(triton.cdiv(k, bk), n * bk * w_bytes, num_sms))


def split_for_bytes_in_flight(steps: int, step_bytes: int, num_sms: int) -> int:
    """K splits of a weight-streaming GEMV whose whole grid reads `step_bytes` per K step: enough
    that IN_FLIGHT_BYTES_PER_SM per SM are in flight, at most MAX_SPLIT_K and the steps, as runs of
    whole steps, none empty (the last may be short). Shared with the W4A16 GEMV (w4a16.py)."""
    split = max(1, min(MAX_SPLIT_K, steps, triton.cdiv(IN_FLIGHT_BYTES_PER_SM * num_sms, step_bytes)))
    return triton.cdiv(steps, triton.cdiv(steps, split))


def block_vec(vec: int, group: int) -> int:
    """Columns a thread takes a step in the block kernel: at most `vec` and a divisor of the scale
    group, so that each thread's chunk lies in one group (8 for bf16 x and 128-column groups)."""
    return min(vec, _pow2_divisor(group, vec))


def block_gemv_supported(block_size: list[int] | tuple[int, int]) -> bool:
    """Any [bn, bk] >= 1 (a thread's chunk of columns narrows to a divisor of bk)."""
    return len(block_size) == 2 and min(int(b) for b in block_size) >= 1


def _check(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    check_operands(x2, weight, scale, bias)  # the tl.dot GEMM's contract: dtypes, shapes, strides, device
    if x2.shape[0] > GEMV_MAX_TOKENS:  # an accumulator per row of x
        raise ValueError(f"the FP8 GEMV takes at most {GEMV_MAX_TOKENS} rows of x, got {x2.shape[0]}")


def check_gemv_config(cfg: Fp8GemvConfig, group: int | None = None) -> None:
    """Tiles any kernel here takes (`group` is accepted for the callers; any step suits any group)."""
    bk, bn = cfg.block_k, cfg.block_n
    if bk < 1 or bk & (bk - 1) or bn < 1 or bn & (bn - 1) or cfg.split_k < 1:
        raise ValueError(f"FP8 GEMV tiles need power-of-two block_n and block_k and split_k >= 1, got {cfg}")


def launch_gemv(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, stride_ws: tuple[int, int], scale_bn: int,
                group: int | None, bias: torch.Tensor | None, cfg: Fp8GemvConfig) -> torch.Tensor:
    """The GEMV (and the split sum) on checked operands; returns [M, N] in x's dtype."""
    (m, k), n = x2.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    if m == 0:
        return out
    per_split, split, target = split_k_target(out, k, cfg.block_k, cfg.split_k)
    grid = (triton.cdiv(n, cfg.block_n), split)
    common = (x2, weight, scale, bias if bias is not None else scale, target, per_split, x2.stride(0), weight.stride(0))
    out_strides = (target.stride(-2), target.stride(0) if split > 1 else 0)
    shared = dict(M=m, N=n, K=k, HAS_BIAS=bias is not None, IS_SPLIT=split > 1, BLOCK_N=cfg.block_n,
                  BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=1)
    vec = min(cfg.block_k, 16 // x2.element_size())  # 16 bytes of x a thread
    if group is None:
        _fp8_gemv_kernel[grid](*common, stride_ws[0], *out_strides, VEC=vec, **shared)
    else:
        _fp8_block_gemv_kernel[grid](*common, *stride_ws, *out_strides, SCALE_BN=scale_bn, GROUP=group,
                                     VEC=block_vec(vec, group), WIDE_ROWS=n * weight.stride(0) >= 2 ** 31, **shared)
    if split > 1:
        sum_splits(target, bias, out)
    return out


def fp8_channel_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: Optional[torch.Tensor] = None, *, config: Fp8GemvConfig | None = None) -> torch.Tensor:
    """x [*, K] with at most GEMV_MAX_TOKENS rows (bf16/fp16/fp32), weight e4m3 [N, K], weight_scale float32
    with 1 or N values (per tensor / per channel) -> [*, N] in x's dtype (module docstring: precision)."""
    shape, (n, k) = x.shape, weight.shape
    x2 = x.reshape(-1, shape[-1])
    _check(x2, weight, weight_scale, bias)
    w_scale, stride_ws = channel_scales(weight_scale, n)
    cfg = config or default_fp8_gemv_config(x2.shape[0], n, k, x2.element_size(), None, sm_count(x.device))
    check_gemv_config(cfg, None)
    return launch_gemv(x2, weight, w_scale, stride_ws, 1, None, bias, cfg).reshape(*shape[:-1], n)


def fp8_block_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, block_size: list[int],
                   bias: Optional[torch.Tensor] = None, *, config: Fp8GemvConfig | None = None) -> torch.Tensor:
    """Block FP8: weight_scale_inv float32 [ceil(N/bn), ceil(K/bk)] for block_size [bn, bk]: the
    loader's row-expanded scales (bn = 1) or the checkpoint's compact ones (e.g. [128, 128])."""
    shape, (n, k) = x.shape, weight.shape
    x2 = x.reshape(-1, shape[-1])
    _check(x2, weight, weight_scale_inv, bias)
    if not block_gemv_supported(block_size):
        raise ValueError(f"block_size must be [bn, bk] with both >= 1, got {list(block_size)}")
    bn, bk = (int(b) for b in block_size)
    expect = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    if weight_scale_inv.dim() != 2 or tuple(weight_scale_inv.shape) != expect:
        raise ValueError(f"weight_scale_inv must be {list(expect)} for weight {tuple(weight.shape)} and block "
                         f"{[bn, bk]}, got {tuple(weight_scale_inv.shape)}")
    cfg = config or default_fp8_gemv_config(x2.shape[0], n, k, x2.element_size(), bk, sm_count(x.device))
    check_gemv_config(cfg, bk)
    out = launch_gemv(x2, weight, weight_scale_inv, weight_scale_inv.stride(), bn, bk, bias, cfg)
    return out.reshape(*shape[:-1], n)


def fp8_gemv_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_size: list[int] | None = None,
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The torch reference of both GEMVs: W dequantized to float32 (per tensor / per channel when
    block_size is None, else by blocks), x in float32 (not quantized), a float32 matmul, the bias in
    float32, rounded once to x's dtype."""
    n = weight.shape[0]
    if block_size is None:
        s = scale.float().reshape(-1)
        w = weight.float() * (s if s.numel() == 1 else s.reshape(n, 1))
    else:
        w = dequantize_fp8_block(weight, scale, tuple(block_size))
    y = x.float().reshape(-1, x.shape[-1]) @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], n)
