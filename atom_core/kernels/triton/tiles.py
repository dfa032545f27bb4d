"""Triton tile helpers the tiled GEMMs share: the grouped launch order, K-tile loads and the
GEMV row epilogue (used by the fused-MoE GEMMs in moe*.py, the dense FP8 GEMM in fp8_gemm.py and
the GEMVs in fp8_gemv.py and w4a16*.py).

Triton inlines every helper, so a kernel compiles as if the lines were written out in it.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_ids(num_m_blocks, NUM_N_BLOCKS: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of this program in grouped order: GROUP_M m blocks sweep the n tiles
    together, so weight tiles are reused from L2."""
    pid = tl.program_id(0)
    width = GROUP_M * NUM_N_BLOCKS
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m_blocks - first_m, GROUP_M)
    return first_m + (pid % width) % size_m, (pid % width) // size_m


@triton.jit
def load_a_tile(a_ptrs, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, MASKED: tl.constexpr):
    """Activation tile [M, BLOCK_K] at K offset k0 (zeros past K)."""
    if MASKED:
        return tl.load(a_ptrs, mask=(k0 + tl.arange(0, BLOCK_K) < K)[None, :], other=0.0)
    return tl.load(a_ptrs)


@triton.jit
def load_w_tile(w_ptrs, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, MASKED: tl.constexpr):
    """Weight tile [BLOCK_K, N] at K offset k0 (zeros past K)."""
    if MASKED:
        return tl.load(w_ptrs, mask=(k0 + tl.arange(0, BLOCK_K) < K)[:, None], other=0.0)
    return tl.load(w_ptrs)


@triton.jit
def store_gemv_row(y, bias_ptr, out_ptrs, rows, col_ok, HAS_BIAS: tl.constexpr, IS_SPLIT: tl.constexpr):
    """One x row's BLOCK_N float32 sums. A split stores float32 partials (the sum kernel adds the
    bias); otherwise the bias is added and the sum rounded once."""
    if IS_SPLIT:
        tl.store(out_ptrs, y, mask=col_ok)
    else:
        if HAS_BIAS:
            y += tl.load(bias_ptr + rows).to(tl.float32)
        tl.store(out_ptrs, y.to(out_ptrs.dtype.element_ty), mask=col_ok)



@triton.jit
def store_gemv_rows(acc0, acc1, acc2, acc3, bias_ptr, out_ptr, stride_om, cols, rows, N, M: tl.constexpr,
                    HAS_BIAS: tl.constexpr, IS_SPLIT: tl.constexpr):
    """The epilogue of a GEMV that keeps one accumulator per x row (M <= 4): each of the first M
    summed over its last axis and stored by store_gemv_row at out_ptr + m * stride_om + cols, the
    columns past N dropped (their weight rows were clamped onto real ones: never stored)."""
    out_ptrs = out_ptr + cols
    col_ok = cols < N
    store_gemv_row(tl.sum(acc0, axis=1), bias_ptr, out_ptrs, rows, col_ok, HAS_BIAS, IS_SPLIT)
    if M > 1:
        store_gemv_row(tl.sum(acc1, axis=1), bias_ptr, out_ptrs + stride_om, rows, col_ok, HAS_BIAS, IS_SPLIT)
    if M > 2:
        store_gemv_row(tl.sum(acc2, axis=1), bias_ptr, out_ptrs + 2 * stride_om, rows, col_ok, HAS_BIAS, IS_SPLIT)
    if M > 3:
        store_gemv_row(tl.sum(acc3, axis=1), bias_ptr, out_ptrs + 3 * stride_om, rows, col_ok, HAS_BIAS, IS_SPLIT)


# Triton's CPU interpreter (TRITON_INTERPRET=1) replaces jit functions by plain Python ones.
INTERPRETED = not isinstance(tile_ids, triton.runtime.jit.JITFunction)
