"""W4A16 GEMM (Triton): y = x @ W^T with W int4 in the layout of `quant/int_ops.py` (qweight int32
[N, K/8], canonical or the kernel layout of `int_ops.interleave_int4`; scales [N, K/G], zeros uint8
[N, K/G] or None: zero 8), dequantized in the inner loop (the weight crosses HBM as 4 bits, never
as bf16). Same signature and contract as `quant.int_ops.w4a16_gemm_ref`.

Two programs:
  * GEMV (M <= GEMV_MAX_M, decode): a program streams BLOCK_N rows of words once for up to 4 rows
    of x (`_w4a16_gemv_kernel`: the arithmetic, why the kernel layout, the instruction count). On a
    GPU the tile is autotuned per shape on first use (a warm-up before any CUDA-graph capture).
    Where it applies (symmetric, the kernel layout, bf16/fp16 x) its packed-half2 sibling runs
    instead (w4a16_gemv_f16x2.py, autotuned the same way): the weights' layout picks the program.
  * GEMM (larger M, prefill): BLOCK_M x BLOCK_N tiles, the dequantized BLOCK_K x BLOCK_N weight
    tile fed to tl.dot in the activation dtype. BLOCK_K divides the group size, so a K step
    reads one scale (and zero) per column.

Why this GEMV: unpacking words into a [BN, BK/8, 8] tensor and reshaping it makes Triton lower
per-step cross-thread shuffles and shared-memory layout conversions, several times the
instructions a weight (offline sm_90 compile), so such a kernel is issue-bound far below the
memory's bandwidth. This one never reshapes: nibble J of a word tile is a
tile of the same layout, and so are its x values in the kernel layout, so a weight costs an AND,
two FFMAs and its share of the x conversion: ~5 instructions a weight at the default tiles
(bf16, M = 1, offline sm_90 SASS), no barrier or shared memory in the loop.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_core.kernels.int4_layout import INT4_INTERLEAVE, check_interleave
from atom_core.kernels.triton.common import (
    check_dim, check_float, check_last_dim_contiguous, check_same_device, next_pow2,
)
from atom_core.kernels.triton.tiles import store_gemv_rows

GEMV_MAX_M = 8
GEMV_ROWS = 4  # x rows a GEMV launch holds (an accumulator each); M 5-8 runs two launches

# (BLOCK_N, BLOCK_KW words a step, warps); the autotuner picks per (N, K, group) on first use
_GEMV_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_KW": bkw}, num_warps=w, num_stages=1)
    for bn, bkw, w in [(16, 64, 4), (32, 64, 4), (16, 128, 4), (8, 128, 4)]
]
MAX_BLOCK_K = max(c.kwargs["BLOCK_KW"] for c in _GEMV_CONFIGS) * 8  # K a multiple of it: no config masks
_GEMV_INTERPRET = {"BLOCK_N": 8, "BLOCK_KW": 8}  # the tile off the GPU
ONE = tl.constexpr(0x3F800000)  # float32 bits of 1.0
MAGIC = tl.constexpr(0x4B000000)  # float32 bits of 2**23: (u | MAGIC) reinterpreted is 2**23 + u exactly (no int->float convert)




@triton.jit
def _nibble(lo, hi, J: tl.constexpr):
    """Nibble J of each word as float32 1 + u * 2**(P - 23). lo = words | ONE holds nibbles 0-4 at
    bits 4J (P = 4J), hi = (words >> 12) | ONE nibbles 5-7 at bits 4J - 12: both already carry the
    exponent of 1.0 in bits 23-29, so one AND with an immediate (mask | ONE) makes the float (no
    int->float convert, no mask register)."""
    if J < 5:
        return (lo & ((15 << (4 * J)) | 0x3F800000)).to(tl.float32, bitcast=True)
    else:
        return (hi & ((15 << (4 * J - 12)) | 0x3F800000)).to(tl.float32, bitcast=True)


@triton.jit
def _pow2(J: tl.constexpr):
    """2**(23 - P) for nibble J: (1 + u * 2**(P - 23)) * 2**(23 - P) = 2**(23 - P) + u, exactly."""
    if J < 5:
        return 2.0 ** (23 - 4 * J)
    else:
        return 2.0 ** (35 - 4 * J)


@triton.jit
def _row_step(acc, lo, hi, x_ptrs, k_ok, zero, scale, MASK_K: tl.constexpr, HAS_ZERO: tl.constexpr,
              V: tl.constexpr):
    """acc [BN, BKW] += scale * sum_J (u_J - zero) * x_J for one x row; x_J, the columns nibble J of
    the words hold, is loaded in the words' layout (V contiguous columns a thread). v * 2**(23 - P)
    - (2**(23 - P) + 8) is one FFMA whose exact result u - 8 is what it rounds to, so a weight costs
    AND + FFMA + FFMA. Asymmetric: the FFMA gives u, and the zero comes out as zero * sum_J x_J, a
    sum per x value, not per weight."""
    part = tl.zeros(acc.shape, dtype=tl.float32)
    xsum = tl.zeros(acc.shape, dtype=tl.float32)
    for J in tl.static_range(8):
        if MASK_K:
            x = tl.load(x_ptrs + J * V, mask=k_ok, other=0.0).to(tl.float32)
        else:
            x = tl.load(x_ptrs + J * V).to(tl.float32)
        if HAS_ZERO:
            part += (_nibble(lo, hi, J) * _pow2(J) - _pow2(J)) * x
            xsum += x
        else:
            part += (_nibble(lo, hi, J) * _pow2(J) - (_pow2(J) + 8.0)) * x
    if HAS_ZERO:
        part -= zero * xsum
    return acc + part * scale


@triton.jit(do_not_specialize=["k_split"])
def _w4a16_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, y_ptr, k_split, stride_xm, stride_qn,
                       stride_sn, stride_zn, stride_ym, stride_ys, N, K, M: tl.constexpr, GROUP: tl.constexpr,
                       V: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                       MASK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr):
    """y[m, cols] for BLOCK_N output columns, all M (<= 4) rows of x, one K split.

    A program streams BLOCK_N rows of packed words once for all its x rows: a [BLOCK_N, BLOCK_KW]
    word tile a step (the next step's tile loads before this one is used: a register double
    buffer) and an accumulator of the same shape per x row; one cross-thread sum at the end. No
    reshape: nibble J of the tile is a tile of the same layout, and so are the x values it meets,
    because the kernel layout (V = 4, `int_ops.interleave_int4`) puts column chunk * 8V + J * V + i
    in nibble J of word i of a V-word chunk: a thread's V words meet V contiguous x values per
    nibble (one vector load). V = 1 is the canonical layout (stride-8 x loads; K not a multiple
    of 32). Scales: a step's words lie in one group (BLOCK_K <= GROUP: one load a row) or each
    word does (8V <= GROUP): a load per word, equal along a thread's V words. Rows past N are
    clamped onto row N - 1 and never stored; columns past K are masked.
    Split-K (grid axis 1): PARTIAL stores float32 partials; fp8_gemm.sum_splits adds them."""
    BLOCK_K: tl.constexpr = BLOCK_KW * 8
    ONE_GROUP_A_STEP: tl.constexpr = BLOCK_K <= GROUP
    split = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(cols, N - 1)
    offs_w = tl.arange(0, BLOCK_KW)
    xcol = (offs_w // V) * (8 * V) + offs_w % V  # nibble 0's column of each word
    k_start = split * (k_split // BLOCK_K) * BLOCK_K  # k_split is a multiple of BLOCK_K: written so, the loads vectorize
    k_end = tl.minimum(k_start + k_split, K)
    w_ptrs = qw_ptr + rows.to(tl.int64)[:, None] * stride_qn + (k_start // 8 + offs_w)[None, :]
    x_ptrs = x_ptr + (k_start + xcol)[None, :] + rows[:, None] * 0  # x in the words' layout (repeats: L1)
    acc0 = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
    w_ok = offs_w[None, :] < (K - k_start) // 8
    if MASK_K:
        words = tl.load(w_ptrs, mask=w_ok, other=0)
    else:
        words = tl.load(w_ptrs)
    for k0 in range(k_start, k_end, BLOCK_K):
        step = tl.where(k0 + BLOCK_K < k_end, BLOCK_KW, 0)  # the last step re-reads its own tile
        if MASK_K:
            words_next = tl.load(w_ptrs + step, mask=offs_w[None, :] < (K - k0) // 8 - step, other=0)
        else:
            words_next = tl.load(w_ptrs + step)
        lo = words | ONE
        hi = (words >> 12) | ONE
        if ONE_GROUP_A_STEP:
            g = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.int32) + k0 // GROUP
        else:
            g = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.int32) + ((k0 + xcol) // GROUP)[None, :]
        scale = tl.load(s_ptr + rows[:, None] * stride_sn + g).to(tl.float32)
        if HAS_ZERO:
            zero = tl.load(z_ptr + rows[:, None] * stride_zn + g).to(tl.float32)
        else:
            zero = scale  # unused
        k_ok = (k0 + xcol)[None, :] < K
        acc0 = _row_step(acc0, lo, hi, x_ptrs, k_ok, zero, scale, MASK_K, HAS_ZERO, V)
        if M > 1:
            acc1 = _row_step(acc1, lo, hi, x_ptrs + stride_xm, k_ok, zero, scale, MASK_K, HAS_ZERO, V)
        if M > 2:
            acc2 = _row_step(acc2, lo, hi, x_ptrs + 2 * stride_xm, k_ok, zero, scale, MASK_K, HAS_ZERO, V)
        if M > 3:
            acc3 = _row_step(acc3, lo, hi, x_ptrs + 3 * stride_xm, k_ok, zero, scale, MASK_K, HAS_ZERO, V)
        words = words_next
        w_ptrs += step
        x_ptrs += BLOCK_K
    store_gemv_rows(acc0, acc1, acc2, acc3, b_ptr, y_ptr + split * stride_ys, stride_ym, cols, rows, N, M, HAS_BIAS,
                    PARTIAL)


# N and K are runtime values (one compile a config, not a shape: start-up time), autotuning keys
_w4a16_gemv_tuned = triton.autotune(configs=_GEMV_CONFIGS, key=["M", "N", "K", "GROUP", "V", "HAS_ZERO"])(_w4a16_gemv_kernel)

def _tuned_gemv(dtype: torch.dtype, consts: dict):
    """The autotuned GEMV a CUDA launch takes, fixed by the weights' layout and x's dtype: the f16x2
    sibling where it applies (symmetric, the kernel layout, bf16/fp16 x), else `_w4a16_gemv_tuned`."""
    if (consts["V"] == INT4_INTERLEAVE and not consts["HAS_ZERO"]
            and dtype in (torch.bfloat16, torch.float16)):
        from atom_core.kernels.triton.w4a16_gemv_f16x2 import _w4a16_gemv_f16x2_tuned

        return _w4a16_gemv_f16x2_tuned
    return _w4a16_gemv_tuned


@triton.jit
def _w4a16_mm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_sn, stride_zn,
                     stride_ym, GROUP: tl.constexpr, V: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
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
        # [BN, chunks, 8 nibbles, V words] in column order: the kernel layout (V = 4) puts column
        # chunk * 8V + J * V + i in nibble J of the chunk's word i; V = 1 is the canonical layout
        words = tl.reshape(words, (BLOCK_N, BLOCK_K // (8 * V), V))
        nib = (words[:, :, None, :] >> shifts[None, None, :, None]) & 0xF
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
    (a power of two >= 32). Small M: narrow N tiles, so N = 4096 still gives 128+ programs, at
    least one an SM (with 64 programs at batch 32 half the SMs idled and the step ran slower than
    bf16's)."""
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
        return _GEMV_INTERPRET["BLOCK_KW"] * 8
    return MAX_BLOCK_K


def gemv_split_k(n: int, k: int, step: int, num_sms: int) -> int:
    """Splits of K by the FP8 GEMV's bytes-in-flight rule (fp8_gemv.split_for_bytes_in_flight) on
    int4 weights, in runs of `step` columns (gemv_split_step: 1,024 on a GPU, where N = 4096 reads
    2 MB a step and does not split). The engine runs 1 split: forced splits measured slower on
    Llama-3-8B's shapes except down (see docs/PERFORMANCE.md), and each split adds a reduction."""
    from atom_core.kernels.triton.fp8_gemv import split_for_bytes_in_flight

    return split_for_bytes_in_flight(triton.cdiv(k, step), n * step // 2, num_sms)


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
               group_size: int, bias: torch.Tensor | None = None, gemv_split: int = 1,
               interleave: int = 1) -> torch.Tensor:
    """y [*, N] = x [*, K] @ W^T (+ bias); see quant.int_ops.w4a16_gemm_ref.

    interleave: 1, qweight in the canonical layout; int_ops.INT4_INTERLEAVE, in the kernel layout
    of `int_ops.interleave_int4` (what the int4 linear methods store when K allows).
    gemv_split: K splits of the GEMV path (M <= GEMV_MAX_M; `gemv_split_k` suggests one)."""
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
    check_interleave(interleave, k)
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
    # One group (per channel): any power of two >= K indexes group 0 for every column.
    consts = dict(GROUP=next_pow2(k) if one_group else group_size, V=interleave, HAS_ZERO=zeros is not None,
                  HAS_BIAS=bias is not None)
    if m <= GEMV_MAX_M:
        _gemv(x2, qweight, scales, z, b, bias, y, gemv_split, consts)
    else:
        bm, bn, bk, warps, stages = _mm_config(m, consts["GROUP"])
        if x.device.type != "cuda":
            bm, bn = 16, 16
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
        _w4a16_mm_kernel[grid](x2, qweight, scales, z, b, y, m, n, k, x2.stride(0), qweight.stride(0),
                               scales.stride(0), z.stride(0), y.stride(0), **consts, BLOCK_M=bm, BLOCK_N=bn,
                               BLOCK_K=bk, num_warps=warps, num_stages=stages,
                               DOT_PRECISION="ieee" if x.dtype == torch.float32 else None,
                               DOT_IN_FP32=x.device.type != "cuda" and x.dtype == torch.bfloat16)
    return y.reshape(*x.shape[:-1], n)


def _gemv(x2, qweight, scales, z, b, bias, y, gemv_split, consts) -> None:
    """The GEMV launches: x rows in blocks of GEMV_ROWS (one launch each), K in `gemv_split` runs."""
    from atom_core.kernels.triton.fp8_gemm import split_k_target, sum_splits

    if gemv_split < 1:
        raise ValueError(f"gemv_split must be >= 1, got {gemv_split}")
    (m, k), n = x2.shape, qweight.shape[0]
    step = gemv_split_step(x2.device)
    for m0 in range(0, m, GEMV_ROWS):
        rows = min(GEMV_ROWS, m - m0)
        xb, yb = x2[m0:m0 + rows], y[m0:m0 + rows]
        steps_per_split, split, target = split_k_target(yb, k, step, gemv_split)
        args = (xb, qweight, scales, z, b, target, steps_per_split * step,
                xb.stride(0), qweight.stride(0), scales.stride(0), z.stride(0), target.stride(-2),
                target.stride(0) if split > 1 else 0, n, k)
        consts_b = dict(consts, M=rows, PARTIAL=split > 1, MASK_K=k % step != 0)
        if x2.device.type == "cuda":
            grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), split)  # noqa: E731
            _tuned_gemv(x2.dtype, consts)[grid](*args, **consts_b)
        else:  # Triton's interpreter: one fixed tile
            grid = (triton.cdiv(n, _GEMV_INTERPRET["BLOCK_N"]), split)
            _w4a16_gemv_kernel[grid](*args, **consts_b, **_GEMV_INTERPRET)
        if split > 1:
            sum_splits(target, bias, yb)
