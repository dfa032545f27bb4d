"""W8A8 INT8 GEMM (Triton): activations quantized per token (one launch), then an int8 x int8
tl.dot accumulating in int32 with the two scales applied in the epilogue (a second launch).
Same signature and contract as `quant.int_ops.int8_w8a8_gemm_ref`, and the same bits up to
the final cast: the quantization does the reference's float32 operations in the same order
(absmax / 127.5, x / scale, round half to even, clamp), the accumulation is exact, and the
epilogue multiplies acc * x_scale * w_scale as the reference does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_core.kernels.triton.common import check_dim, check_float, check_last_dim_contiguous, check_same_device, next_pow2


@triton.jit
def _quant_per_token_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_K)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    # IEEE divisions (div_rn): Triton's `/` on float32 is approximate on the GPU and moved values
    # across rounding boundaries
    scale = tl.div_rn(tl.max(tl.abs(x), axis=0), 127.5)
    scale = tl.where(scale == 0.0, 1.0, scale)
    v = tl.div_rn(x, tl.zeros_like(x) + scale)
    r = tl.floor(v + 0.5)
    tie_to_odd = ((r - v) == 0.5) & ((r - 2.0 * tl.floor(r * 0.5)) != 0.0)  # round half to even
    r = tl.where(tie_to_odd, r - 1.0, r)
    r = tl.minimum(tl.maximum(r, -128.0), 127.0)
    tl.store(q_ptr + row * stride_qm + offs, r.to(tl.int8), mask=mask)
    tl.store(s_ptr + row, scale)


@triton.jit
def _int8_mm_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, bias_ptr, y_ptr, M, N, K, stride_am, stride_bn, stride_ym,
                    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + k[None, :], mask=mask_m[:, None] & (k < K)[None, :], other=0)
        b = tl.load(b_ptr + offs_n[None, :] * stride_bn + k[:, None], mask=mask_n[None, :] & (k < K)[:, None], other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    sa = tl.load(sa_ptr + offs_m, mask=mask_m, other=0.0)
    sb = tl.load(sb_ptr + offs_n, mask=mask_n, other=0.0)
    y = acc.to(tl.float32) * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], float32 [M, 1]); see quant.int_ops.quantize_per_token_int8."""
    check_float("x", x)
    check_dim("x", x, 2)
    check_last_dim_contiguous("x", x)
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        block = next_pow2(k)
        _quant_per_token_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), BLOCK_K=block,
                                      num_warps=8 if block >= 4096 else 4)
    return q, scale


def _config(m: int) -> tuple[int, int, int, int, int]:
    if m <= 16:
        return 16, 64, 256, 4, 4
    if m <= 64:
        return 64, 64, 128, 4, 4
    return 128, 128, 128, 8, 3


def int8_w8a8_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [*, N] = quant(x) @ weight^T * scales (+ bias); see quant.int_ops.int8_w8a8_gemm_ref."""
    check_dim("weight", weight, 2)
    check_same_device(x=x, weight=weight, weight_scale=weight_scale)
    if weight.dtype != torch.int8:
        raise ValueError(f"weight has dtype {weight.dtype}; expected int8")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has K={x.shape[-1]}, weight {tuple(weight.shape)}")
    if weight_scale.numel() != n or weight_scale.dtype != torch.float32:
        raise ValueError(f"weight_scale must be float32 with {n} values, got {weight_scale.dtype} "
                         f"{tuple(weight_scale.shape)}")
    check_last_dim_contiguous("weight", weight)
    x2 = x.reshape(-1, k).contiguous()
    q, x_scale = quantize_per_token_int8(x2)
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        bm, bn, bk, warps, stages = _config(m)
        if x.device.type != "cuda":  # Triton's interpreter: small tiles
            bm, bn, bk = 16, 16, 32
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
        _int8_mm_kernel[grid](q, weight, x_scale, weight_scale.reshape(-1).contiguous(), bias if bias is not None else x_scale, y, m, n, k,
                              q.stride(0), weight.stride(0), y.stride(0), HAS_BIAS=bias is not None,
                              BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return y.reshape(*x.shape[:-1], n)
