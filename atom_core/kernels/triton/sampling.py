"""Gumbel-max sampling (Triton): one read of the logits per decode step.

Math
  With G_v i.i.d. standard Gumbel, argmax_v (l_v / T + G_v) is a sample of softmax(l / T).
  The kernel takes argmax_v (l_v + T * G_v), the same argmax scaled by T > 0, so there is no
  division (no overflow for tiny T) and T = 0 gives argmax_v l_v exactly: greedy rows need no
  special case, though they skip the noise to save time.

Work split
  Grid = (B, num_splits). Program (r, s) scans columns [s * cols_per_split, ...) of row r in
  BLOCK-wide chunks, keeping a running max and its column per lane (ties: lowest column, like
  torch.argmax), and writes its best (score, column); a second kernel reduces each row's
  num_splits partials to the token id. num_splits comes from B, V and the SM count only, so
  the grid fills the GPU at batch 1 (one chunk per program) and at batch 256 alike.

Noise
  Philox4x32-10 (Triton's tl.rand generator) with counter (column // 4, row, offset_lo,
  offset_hi) and key (seed_lo, seed_hi); one counter gives four 32-bit words for four
  adjacent columns. Every (offset, row, column) has its own counter without any index
  arithmetic, so nothing can overflow at any B * V, and the noise does not depend on BLOCK or
  num_splits. Callers pass a fresh offset per call (offset + 1 is enough).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from atom_core.kernels.triton.common import (
    check_dim, check_float, check_last_dim_contiguous, check_same_device, next_pow2, sm_count,
)

# Columns per chunk (a multiple of 4: one Philox call per 4 columns) and warps per program.
BLOCK = 1024
NUM_WARPS = 4
# Programs per SM to aim for: enough resident warps to hide HBM latency at batch 128-256,
# one chunk per program at batch 1 (V = 152K gives 149 programs).
TARGET_PROGRAMS_PER_SM = 8
# seed and offset travel as two 31-bit halves each, so Triton always types them int32 (a value
# past 2**31 would otherwise switch the argument to int64 and compile a second kernel).
_MASK31 = (1 << 31) - 1
_INT32_MAX = tl.constexpr(2147483647)


@triton.jit
def _log(x, FAST_LOG: tl.constexpr):
    if FAST_LOG:  # CUDA: one MUFU op instead of a ~25-instruction libdevice log
        return libdevice.fast_logf(x)
    else:
        return tl.log(x)


@triton.jit
def _standard_gumbel(bits, FAST_LOG: tl.constexpr):
    """uint32 random words -> standard Gumbel noise, always finite."""
    # v = 1 - U with U uniform in (0, 1): 23 bits + 1/2 keeps v and 1 - v exact in fp32, never 0 or 1.
    v = ((bits >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23
    # E = -log(1 - v) ~ Exp(1). Small E (large G: the draws that win) comes from the series
    # v + v^2/2 + v^3/3 + v^4/4 (rel. error < 1e-8 below 2**-6), because a fast log's error
    # near 1 is absolute, not relative; elsewhere its error moves G by < 2e-5.
    series = v * (1.0 + v * (0.5 + v * (0.33333334 + v * 0.25)))
    e = tl.where(v < 0.015625, series, -_log(1.0 - v, FAST_LOG))
    return -_log(e, FAST_LOG)


@triton.jit
def _chunk_scores(row_ptr, chunk, end, row, temp, keys, offs,
                  BLOCK: tl.constexpr, NOISE: tl.constexpr, MASKED: tl.constexpr, FAST_LOG: tl.constexpr):
    """Scores l + T * G of columns [chunk, chunk + BLOCK) as [BLOCK // 4, 4] tiles, and their columns."""
    quad = tl.arange(0, BLOCK // 4)
    word = tl.arange(0, 4)
    cols = chunk + quad[:, None] * 4 + word[None, :]  # 4 contiguous columns per quad
    if MASKED:
        x = tl.load(row_ptr + cols, mask=cols < end, other=float("-inf"))
    else:  # full chunks: no mask, so loads vectorise
        x = tl.load(row_ptr + cols)
    x = x.to(tl.float32)
    if NOISE:
        zero = quad.to(tl.uint32) * 0
        counter = (chunk // 4 + quad).to(tl.uint32)
        r0, r1, r2, r3 = tl.philox_impl(counter, zero + row, zero + offs[0], zero + offs[1], keys[0], keys[1])
        bits = tl.where(word == 0, r0[:, None], tl.where(
            word == 1, r1[:, None], tl.where(word == 2, r2[:, None], r3[:, None])))
        x = x + temp * _standard_gumbel(bits, FAST_LOG)  # -inf stays -inf: the noise is finite
    return x, cols


@triton.jit
def _keep_better(best, best_col, x, cols):
    better = x > best  # strict: a lane sees increasing columns, so ties keep the lowest
    return tl.where(better, x, best), tl.where(better, cols, best_col)


@triton.jit
def _scan_columns(row_ptr, start, end, row, temp, keys, offs,
                  BLOCK: tl.constexpr, NOISE: tl.constexpr, FAST_LOG: tl.constexpr):
    """Per-lane running (max score, column) over columns [start, end); start % BLOCK == 0."""
    best = tl.full([BLOCK // 4, 4], float("-inf"), tl.float32)
    # Starting at the first chunk's columns makes an all -inf range report `start`, so an
    # all -inf row returns 0 like torch.argmax; -inf never beats the initial best otherwise.
    best_col = start + tl.arange(0, BLOCK // 4)[:, None] * 4 + tl.arange(0, 4)[None, :]
    full_end = start + (end - start) // BLOCK * BLOCK
    for chunk in range(start, full_end, BLOCK):
        x, cols = _chunk_scores(row_ptr, chunk, end, row, temp, keys, offs, BLOCK, NOISE, False, FAST_LOG)
        best, best_col = _keep_better(best, best_col, x, cols)
    if full_end < end:  # the vocab's ragged tail, in the last split only
        x, cols = _chunk_scores(row_ptr, full_end, end, row, temp, keys, offs, BLOCK, NOISE, True, FAST_LOG)
        best, best_col = _keep_better(best, best_col, x, cols)
    return best, best_col


# The split sizes change with the batch size: as specialisation keys (== 1, % 16) they compiled
# new variants in the middle of runs (1.2 s of a Llama-3-8B nano run on a cold cache).
@triton.jit(do_not_specialize=["cols_per_split", "num_splits", "seed_lo", "seed_hi", "off_lo", "off_hi"])
def _gumbel_argmax_partial_kernel(
    logits_ptr, temps_ptr, part_val_ptr, part_col_ptr, stride_row, stride_temp, n_cols,
    cols_per_split, num_splits, seed_lo, seed_hi, off_lo, off_hi, BLOCK: tl.constexpr, FAST_LOG: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    start = split * cols_per_split
    end = tl.minimum(start + cols_per_split, n_cols)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    temp = tl.maximum(tl.load(temps_ptr + row * stride_temp), 0.0)
    keys = (seed_lo.to(tl.uint32), seed_hi.to(tl.uint32))  # Philox key: the 62-bit seed
    offs = (off_lo.to(tl.uint32), off_hi.to(tl.uint32))
    if temp > 0:
        best, best_col = _scan_columns(row_ptr, start, end, row.to(tl.uint32), temp, keys, offs,
                                       BLOCK, True, FAST_LOG)
    else:  # greedy row: the same scan without the Philox work
        best, best_col = _scan_columns(row_ptr, start, end, row.to(tl.uint32), temp, keys, offs,
                                       BLOCK, False, FAST_LOG)
    top = tl.max(best)
    out = row * num_splits + split
    tl.store(part_val_ptr + out, top)
    tl.store(part_col_ptr + out, tl.min(tl.where(best == top, best_col, _INT32_MAX)))


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_splits_kernel(part_val_ptr, part_col_ptr, out_ptr, num_splits, BLOCK_S: tl.constexpr):
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    ok = s < num_splits
    val = tl.load(part_val_ptr + row * num_splits + s, mask=ok, other=float("-inf"))
    col = tl.load(part_col_ptr + row * num_splits + s, mask=ok, other=_INT32_MAX)
    # Lowest column among the tied maxima; all -inf picks split 0's column 0.
    best = tl.min(tl.where(val == tl.max(val), col, _INT32_MAX))
    tl.store(out_ptr + row, best.to(tl.int64))


def _has_fast_log(device: torch.device) -> bool:
    # libdevice.fast_logf exists for NVIDIA only; ROCm and the CPU interpreter use tl.log.
    return device.type == "cuda" and torch.version.hip is None


def choose_split(num_rows: int, n_cols: int, device: torch.device,
                 num_splits: int | None = None) -> tuple[int, int]:
    """(cols_per_split, num_splits): ~TARGET_PROGRAMS_PER_SM programs per SM (or the asked
    num_splits), each split a whole number of chunks and none empty."""
    num_chunks = triton.cdiv(n_cols, BLOCK)
    if num_splits is None:
        num_splits = triton.cdiv(TARGET_PROGRAMS_PER_SM * sm_count(device), num_rows)
    chunks_per_split = triton.cdiv(num_chunks, max(1, min(num_chunks, num_splits)))
    return chunks_per_split * BLOCK, triton.cdiv(num_chunks, chunks_per_split)


def gumbel_argmax(logits: torch.Tensor, temperatures: torch.Tensor, seed: int, offset: int,
                  num_splits: int | None = None) -> torch.Tensor:
    """Sample one token per row of softmax(logits / T); rows with T == 0 take argmax(logits).

    logits: [B, V] float32/bf16/fp16, any row stride, unit column stride. temperatures: [B]
    float32 (negative counts as 0). seed, offset: any ints, used modulo 2**62; the noise is a
    pure function of (seed, offset, row, column), so equal arguments give equal tokens and a
    caller wants a fresh offset per call. Returns [B] int64. -inf logits are never picked
    unless the whole row is -inf (then 0). No host sync; a CUDA graph that captures this call
    freezes seed and offset, so each replay repeats the same noise. num_splits overrides the
    heuristic (tests).
    """
    check_dim("logits", logits, 2)
    check_float("logits", logits)
    check_last_dim_contiguous("logits", logits)
    check_same_device(logits=logits, temperatures=temperatures)
    num_rows, n_cols = logits.shape
    if temperatures.dtype != torch.float32 or temperatures.shape != (num_rows,):
        raise ValueError(f"temperatures must be float32 [{num_rows}], got {temperatures.dtype} "
                         f"{tuple(temperatures.shape)}")
    if n_cols == 0:
        raise ValueError("logits has an empty vocab dimension")
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    cols_per_split, splits = choose_split(num_rows, n_cols, logits.device, num_splits)
    part_val = torch.empty(num_rows, splits, dtype=torch.float32, device=logits.device)
    part_col = torch.empty(num_rows, splits, dtype=torch.int32, device=logits.device)
    _gumbel_argmax_partial_kernel[(num_rows, splits)](
        logits, temperatures, part_val, part_col, logits.stride(0), temperatures.stride(0), n_cols,
        cols_per_split, splits, seed & _MASK31, (seed >> 31) & _MASK31, offset & _MASK31,
        (offset >> 31) & _MASK31, BLOCK=BLOCK, FAST_LOG=_has_fast_log(logits.device), num_warps=NUM_WARPS,
    )
    # BLOCK_S from the vocab (the most splits any batch can get), so one variant serves every batch.
    max_splits = triton.cdiv(n_cols, BLOCK)
    _reduce_splits_kernel[(num_rows,)](part_val, part_col, out, splits, BLOCK_S=max(2, next_pow2(max_splits)),
                                       num_warps=1)
    return out
