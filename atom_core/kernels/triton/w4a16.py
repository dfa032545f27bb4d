"""W4A16 GEMM (Triton): y = x @ W^T with W int4 in the canonical layout of `quant/int_ops.py`
(qweight int32 [N, K/8], scales [N, K/G], zeros uint8 [N, K/G] or None: zero 8), dequantized
in the inner loop (Marlin-style: the weight crosses HBM as 4 bits, never as bf16).
Same signature and contract as `quant.int_ops.w4a16_gemm_ref`.

Two programs:
  * GEMV (M <= GEMV_MAX_M, decode): a program owns BLOCK_N output columns of one row of x and
    walks K in BLOCK_K steps: load BLOCK_N x BLOCK_K/8 words, unpack them to nibbles in
    registers, scale, multiply by x and accumulate in float32; one reduction at the end. Small
    BLOCK_N keeps hundreds of programs in flight (batch-1 decode is a pure weight stream). On a
    GPU the tile is autotuned per (N, K) on first use (a warm-up before any CUDA-graph capture).
  * GEMM (larger M, prefill): BLOCK_M x BLOCK_N tiles, the dequantized BLOCK_K x BLOCK_N weight
    tile fed to tl.dot in the activation dtype. BLOCK_K divides the group size, so a K step
    reads one scale (and zero) per column.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_core.kernels.triton.common import (
    check_dim, check_float, check_last_dim_contiguous, check_same_device, next_pow2,
)

GEMV_MAX_M = 8

_GEMV_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "FACTORED": f}, num_warps=w, num_stages=2)
    for bn, bk, w, f in [(8, 256, 4, True), (8, 512, 4, True), (16, 256, 4, True), (16, 512, 8, True),
                         (4, 512, 4, True), (8, 512, 4, False), (16, 256, 4, False)]
]
_GEMV_INTERPRET = {"BLOCK_N": 8, "BLOCK_K": 64, "FACTORED": True}  # the tile off the GPU (tests flip FACTORED)
MAGIC = tl.constexpr(0x4B000000)  # float32 bits of 2**23: (u | MAGIC) reinterpreted is 2**23 + u exactly (no int->float convert)


@triton.jit
def _w4a16_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, y_ptr, N, K, stride_xm, stride_qn, stride_sn, stride_zn,
                       stride_ym, k_split, stride_ys, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
                       HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FACTORED: tl.constexpr):
    # A K step covers NG whole groups of SUB columns (SUB = min(GROUP, BLOCK_K)), so scales and
    # zeros load once per group as [BLOCK_N, NG] and broadcast over the group's columns.
    # FACTORED: per group, scale * (sum_k u_k x_k - zero * sum_k x_k), so the per-element work is
    # unpack + one fma (the scale and zero move out of the inner product); otherwise every element
    # is dequantized, (u - zero) * scale * x. The autotuner picks per shape (the ALU work per
    # byte, not the bytes, is what limits a 4-bit GEMV).
    SUB: tl.constexpr = GROUP if GROUP < BLOCK_K else BLOCK_K
    NG: tl.constexpr = BLOCK_K // SUB
    # Split-K (grid axis 2): program s walks K columns [s * k_split, (s + 1) * k_split), k_split a
    # multiple of every BLOCK_K, and with PARTIAL stores float32 partials (fp8_gemm.sum_splits adds
    # them and the bias) instead of the output.
    pid_n = tl.program_id(0)
    m = tl.program_id(1)
    k_start = tl.program_id(2) * k_split
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_w = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    offs_k = tl.arange(0, BLOCK_K)
    offs_g = tl.arange(0, NG) * SUB
    if FACTORED:
        acc = tl.zeros([BLOCK_N, NG], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, NG, SUB], dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(K, k_start + k_split), BLOCK_K):
        words = tl.load(qw_ptr + offs_n[:, None] * stride_qn + (k0 // 8 + offs_w)[None, :],
                        mask=mask_n[:, None] & ((k0 + offs_w * 8) < K)[None, :], other=0)
        nib = (words[:, :, None] >> shifts[None, None, :]) & 0xF  # [BLOCK_N, BLOCK_K/8, 8]
        if FACTORED:
            w = tl.reshape(nib | MAGIC, (BLOCK_N, NG, SUB)).to(tl.float32, bitcast=True) - 8388608.0
        else:
            w = tl.reshape(nib, (BLOCK_N, NG, SUB)).to(tl.float32)
        g = (k0 + offs_g) // GROUP
        mask_g = mask_n[:, None] & ((k0 + offs_g) < K)[None, :]
        scale = tl.load(s_ptr + offs_n[:, None] * stride_sn + g[None, :], mask=mask_g, other=0.0).to(tl.float32)
        if HAS_ZERO:
            zero = tl.load(z_ptr + offs_n[:, None] * stride_zn + g[None, :], mask=mask_g, other=0).to(tl.float32)
        else:
            zero = tl.full([BLOCK_N, NG], 8.0, tl.float32)
        k = k0 + offs_k
        xv = tl.reshape(tl.load(x_ptr + m * stride_xm + k, mask=k < K, other=0.0).to(tl.float32), (1, NG, SUB))
        if FACTORED:
            acc += scale * (tl.sum(w * xv, axis=2) - zero * tl.sum(xv, axis=2))
        else:
            acc += (w - zero[:, :, None]) * scale[:, :, None] * xv
    if FACTORED:
        out = tl.sum(acc, axis=1)
    else:
        out = tl.sum(tl.sum(acc, axis=2), axis=1)
    if PARTIAL:
        tl.store(y_ptr + tl.program_id(2) * stride_ys + m * stride_ym + offs_n, out, mask=mask_n)
    else:
        if HAS_BIAS:
            out += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * stride_ym + offs_n, out.to(y_ptr.dtype.element_ty), mask=mask_n)


_w4a16_gemv_tuned = triton.autotune(configs=_GEMV_CONFIGS, key=["N", "K", "GROUP"])(_w4a16_gemv_kernel)


@triton.jit
def _w4a16_mm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_sn, stride_zn,
                     stride_ym, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < K
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        words = tl.load(qw_ptr + offs_n[:, None] * stride_qn + (k0 // 8 + offs_w)[None, :],
                        mask=mask_n[:, None] & ((k0 + offs_w * 8) < K)[None, :], other=0)
        nib = (words[:, :, None] >> shifts[None, None, :]) & 0xF
        w = tl.trans(tl.reshape(nib | MAGIC, (BLOCK_N, BLOCK_K))).to(tl.float32, bitcast=True)  # 2**23 + u
        g = k0 // GROUP  # BLOCK_K divides GROUP: one group per step
        scale = tl.load(s_ptr + offs_n * stride_sn + g, mask=mask_n, other=0.0).to(tl.float32)
        if HAS_ZERO:
            zero = tl.load(z_ptr + offs_n * stride_zn + g, mask=mask_n, other=0).to(tl.float32) + 8388608.0
        else:
            zero = tl.full([BLOCK_N], 8.0 + 8388608.0, tl.float32)
        w = ((w - zero[None, :]) * scale[None, :]).to(x_ptr.dtype.element_ty)  # exact: both sides are 2**23 + int
        if DOT_IN_FP32:  # the interpreter's bf16 dot is wrong; same rounded operands, fp32 product
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def _mm_config(m: int, group: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by M; BLOCK_K divides the group size
    (a power of two >= 32). Small M: narrow N tiles, so N = 4096 still gives 128+ programs (the
    first H100 run had 64 programs at batch 32, and a 1.7x slower step than bf16)."""
    if m <= 16:
        return 16, 32, min(group, 128), 4, 4
    if m <= 32:
        return 32, 32, min(group, 128), 4, 4
    if m <= 64:
        return 64, 64, min(group, 64), 4, 3
    return 128, 128, min(group, 64), 8, 3


def gemv_split_step(device: torch.device) -> int:
    """K columns a split's run is a multiple of: the largest BLOCK_K the GEMV runs with here."""
    if device.type != "cuda":
        return _GEMV_INTERPRET["BLOCK_K"]
    return max(c.kwargs["BLOCK_K"] for c in _GEMV_CONFIGS)


def gemv_split_k(n: int, k: int, step: int, num_sms: int) -> int:
    """Splits of K by the FP8 GEMV's bytes-in-flight rule (fp8_gemv.split_for_bytes_in_flight) on
    int4 weights: N = 4096 rows read 1 MB per 512-column step, under the 1.6 MB an H100's 132 SMs
    want, so K splits in 2; gate_up's 28,672 rows do not split."""
    from atom_core.kernels.triton.fp8_gemv import split_for_bytes_in_flight

    return split_for_bytes_in_flight(triton.cdiv(k, step), n * step // 2, num_sms)


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
               group_size: int, bias: torch.Tensor | None = None, gemv_split: int = 1) -> torch.Tensor:
    """y [*, N] = x [*, K] @ W^T (+ bias); see quant.int_ops.w4a16_gemm_ref.

    gemv_split: K splits of the GEMV path (M <= GEMV_MAX_M; `gemv_split_k` suggests one). 1, the
    default, until the split is measured on a GPU (tests/gpu/bench_int4.py times both)."""
    check_float("x", x)
    check_dim("qweight", qweight, 2)
    check_same_device(x=x, qweight=qweight, scales=scales)
    if qweight.dtype != torch.int32:
        raise ValueError(f"qweight has dtype {qweight.dtype}; expected int32")
    n, k = qweight.shape[0], x.shape[-1]
    one_group = group_size == k
    if k % group_size or qweight.shape[1] * 8 != k or not (one_group or (group_size & (group_size - 1) == 0
                                                                          and group_size >= 32)):
        raise ValueError(f"x has K={k}, qweight {tuple(qweight.shape)}, group size {group_size}: the kernel needs "
                         f"qweight [N, K/8] and a group size that divides K and is a power of two >= 32, or is K "
                         f"(per channel)")
    if scales.shape != (n, k // group_size):
        raise ValueError(f"scales shape {tuple(scales.shape)} != ({n}, {k // group_size})")
    if zeros is not None and (zeros.shape != scales.shape or zeros.dtype != torch.uint8):
        raise ValueError(f"zeros must be uint8 of shape {tuple(scales.shape)}, got {zeros.dtype} {tuple(zeros.shape)}")
    x2 = x.reshape(-1, k)
    check_last_dim_contiguous("x", x2)
    for name, t in (("qweight", qweight), ("scales", scales)):
        check_last_dim_contiguous(name, t)
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    z = zeros if zeros is not None else scales  # a dummy pointer when HAS_ZERO is false
    b = bias if bias is not None else scales
    args = (x2, qweight, scales, z, b, y, *((m,) if m > GEMV_MAX_M else ()), n, k, x2.stride(0), qweight.stride(0),
            scales.stride(0), z.stride(0), y.stride(0))
    # One group (per channel): any power of two >= K indexes group 0 for every column.
    consts = dict(GROUP=next_pow2(k) if one_group else group_size, HAS_ZERO=zeros is not None, HAS_BIAS=bias is not None)
    if m <= GEMV_MAX_M:
        if gemv_split < 1:
            raise ValueError(f"gemv_split must be >= 1, got {gemv_split}")
        from atom_core.kernels.triton.fp8_gemm import split_k_target, sum_splits

        step = gemv_split_step(x.device)
        steps_per_split, split, target = split_k_target(y, k, step, gemv_split)
        args = (x2, qweight, scales, z, b, target, n, k, x2.stride(0), qweight.stride(0), scales.stride(0), z.stride(0),
                target.stride(-2), steps_per_split * step, target.stride(0) if split > 1 else 0)
        consts["PARTIAL"] = split > 1
        if x.device.type == "cuda":
            grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), m, split)  # noqa: E731
            _w4a16_gemv_tuned[grid](*args, **consts)
        else:  # Triton's interpreter: one fixed tile
            grid = (triton.cdiv(n, _GEMV_INTERPRET["BLOCK_N"]), m, split)
            _w4a16_gemv_kernel[grid](*args, **consts, **_GEMV_INTERPRET)
        if split > 1:
            sum_splits(target, bias, y)
    else:
        bm, bn, bk, warps, stages = _mm_config(m, consts["GROUP"])
        if x.device.type != "cuda":
            bm, bn = 16, 16
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
        _w4a16_mm_kernel[grid](*args, **consts, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
                               DOT_PRECISION="ieee" if x.dtype == torch.float32 else None,
                               DOT_IN_FP32=x.device.type != "cuda" and x.dtype == torch.bfloat16)
    return y.reshape(*x.shape[:-1], n)
