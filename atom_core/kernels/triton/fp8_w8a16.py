"""Weight-only FP8 GEMM for small batches (Triton): y [M, N] = x [M, K] @ dequant(W)^T (+ bias) for
2 <= M <= W8A16_MAX_TOKENS, W e4m3 [N, K] with a per-tensor or per-channel scale, x bf16/fp16/fp32
and NOT quantized (W8A16, the GEMM sibling of fp8_gemv.py's GEMV):

  fp8_w8a16_gemm(x, weight, weight_scale, bias, split_k=None)   ~ fp8_gemv_ref(x, weight, weight_scale)

Why: at 2-64 tokens a linear still streams its weights once, but `_scaled_mm` runs well above the
bytes floor on narrow shapes (measured: see docs/PERFORMANCE.md) and needs a quantizer launch per
linear. Here each program owns BLOCK_N output columns and
one K split: per step it loads a BLOCK_M x BLOCK_K tile of x (all rows: L2-resident) and a
BLOCK_N x BLOCK_K tile of e4m3 weights, widens the weights to x's dtype in registers (e4m3 values
are exact in bf16, fp16 and fp32) and runs one tensor-core dot into float32; Triton's software
pipeline keeps num_stages tiles in flight. The per-channel scale multiplies the float32 sums once.

Split-K (grid axis 1) until the grid has about PROGRAMS_PER_SM programs per SM: N = 4,096 gives 64
column tiles, too few to keep every SM streaming, so K splits in 4; partials [SPLIT, M, N] (scaled,
float32) are added by fp8_gemm.sum_splits in split order (deterministic), with the bias, rounded
once. Precision: more accurate than fp8_linear_ref (x is not quantized); bf16/fp16 x meets the
weights in its own dtype on the tensor cores (float32 accumulation), float32 x in IEEE float32.

Where it wins: with the swept tiles (`default_tiles`) it beats _scaled_mm + quantizer on every
Llama-3-8B shape at 8 tokens; at 32 tokens only on the narrow shapes (the wide gate_up has enough
rows for _scaled_mm's tensor-core tiles), and at 64 tokens nowhere. So fp8_ops' linear table takes
it at 2-16 tokens, and at 17-32 for outputs of at most 8,192 columns (measured: see
docs/PERFORMANCE.md). Narrow shapes still run above their bytes floor.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from atom_core.kernels.triton.common import sm_count
from atom_core.kernels.triton.fp8_gemm import channel_scales, check_operands, split_k_target, sum_splits

W8A16_MAX_TOKENS = 64  # tokens the kernel takes (BLOCK_M up to 64: one M tile)
PROGRAMS_PER_SM = 2
MAX_SPLIT_K = 8


@triton.jit(do_not_specialize=["M", "steps_per_split"])
def _w8a16_kernel(x_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, M, N, K, steps_per_split, stride_xm, stride_wn, stride_ws,
                  stride_om, stride_os, HAS_BIAS: tl.constexpr, IS_SPLIT: tl.constexpr, MASK_K: tl.constexpr,
                  IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    split = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)  # weight rows past N: clamped, never stored
    offs_k = tl.arange(0, BLOCK_K)
    k_start = split * steps_per_split * BLOCK_K
    k_end = tl.minimum(k_start + steps_per_split * BLOCK_K, K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :]
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + (k_start + offs_k)[None, :]
    m_ok = offs_m[:, None] < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if MASK_K:
            k_ok = (k0 + offs_k)[None, :] < K
            a = tl.load(x_ptrs, mask=m_ok & k_ok, other=0.0)
            w = tl.load(w_ptrs, mask=k_ok, other=0.0)
        else:
            a = tl.load(x_ptrs, mask=m_ok, other=0.0)
            w = tl.load(w_ptrs)
        if IEEE:  # float32 x, and the interpreter (whose bf16 dot is wrong): the same products in float32
            acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc)  # e4m3 -> x's dtype: exact
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    scale = tl.load(ws_ptr + rows * stride_ws)
    acc = acc * scale[None, :]
    out_ptrs = out_ptr + split * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    out_ok = m_ok & (offs_n[None, :] < N)
    if IS_SPLIT:
        tl.store(out_ptrs, acc, mask=out_ok)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_ok)


def default_tiles(m: int, n: int, k: int, num_sms: int, x_bytes: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, split_k, num_warps, num_stages): one M tile (the MMA's minimum 16
    rows up to 64), split-K to about PROGRAMS_PER_SM programs an SM, 3 stages. The fastest of a tile
    sweep on Llama-3-8B shapes at 8 and 32 tokens (see docs/PERFORMANCE.md): up to 16 tokens 32
    columns a program and 256 K a step (128 for outputs wider than 8,192, which have tiles enough
    without deep K steps), above 64 columns and 128 K."""
    block_m = max(16, triton.next_power_of_2(m))
    if block_m <= 16:
        block_n, block_k = 32, (256 if n <= 8192 and x_bytes == 2 else 128)
    else:
        block_n, block_k = 64, 128
    block_k = max(16, min(block_k, triton.next_power_of_2(k)))
    tiles = triton.cdiv(n, block_n)
    split = max(1, min(MAX_SPLIT_K, triton.cdiv(k, block_k), triton.cdiv(PROGRAMS_PER_SM * num_sms, tiles)))
    return block_m, block_n, block_k, split, 4, 3


def fp8_w8a16_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: Optional[torch.Tensor] = None, split_k: int | None = None,
                   tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """y [*, N] = x [*, K] @ (weight * weight_scale)^T (+ bias) for at most W8A16_MAX_TOKENS rows of x;
    weight e4m3 [N, K], weight_scale float32 with 1 or N values. split_k: K splits (None: by the grid);
    tiles: (BLOCK_N, BLOCK_K, num_warps, num_stages) instead of `default_tiles`' (the benchmark's sweep)."""
    shape, (n, k) = x.shape, weight.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    weight_scale = weight_scale.float()
    check_operands(x2, weight, weight_scale, bias)
    m = x2.shape[0]
    if m > W8A16_MAX_TOKENS:
        raise ValueError(f"fp8_w8a16_gemm takes at most {W8A16_MAX_TOKENS} rows of x, got {m}")
    if split_k is not None and split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")
    w_scale, (stride_ws, _) = channel_scales(weight_scale.float(), n)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*shape[:-1], n)
    interpret = x.device.type != "cuda"
    num_sms = 4 if interpret else sm_count(x.device)
    bm, bn, bk, split, warps, stages = default_tiles(m, n, k, num_sms, x.element_size())
    if tiles is not None:
        bn, bk, warps, stages = tiles
        split = max(1, min(MAX_SPLIT_K, triton.cdiv(k, bk), triton.cdiv(PROGRAMS_PER_SM * num_sms, triton.cdiv(n, bn))))
    if interpret:
        bn, bk = 16, 32
        split = min(split, triton.cdiv(k, bk))
    steps_per_split, split, target = split_k_target(out, k, bk, split if split_k is None else split_k)
    _w8a16_kernel[(triton.cdiv(n, bn), split)](
        x2, weight, w_scale, bias if bias is not None else w_scale, target, m, n, k, steps_per_split, x2.stride(0),
        weight.stride(0), stride_ws, target.stride(-2), target.stride(0) if split > 1 else 0,
        HAS_BIAS=bias is not None, IS_SPLIT=split > 1, MASK_K=k % bk != 0, IEEE=x.dtype == torch.float32 or interpret,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    if split > 1:
        sum_splits(target, bias, out)
    return out.reshape(*shape[:-1], n)
