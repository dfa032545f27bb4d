"""W4A16 decode GEMV in packed half2 arithmetic (CUDA only): the sibling of w4a16.py's
`_w4a16_gemv_kernel` (same arguments and contract) for symmetric weights (zero 8) in the kernel
layout (INT4_INTERLEAVE = 4) with bf16 / fp16 x, taken wherever the layout allows
(w4a16._tuned_gemv): faster than the float32 GEMV at 1 to 4 tokens (measured: see
docs/PERFORMANCE.md).

Why: the float32 GEMV issues ~5 SASS instructions a weight (an AND and two FFMAs each, plus x
conversions) and is issue-bound well below the memory's bandwidth. Here each instruction serves a pair
of weights (Marlin's and FasterTransformer's trick), in inline PTX:
  * dequantize (DEQUANT_ASM): `lop3 (w & 0x000F000F) | 0x64006400` makes the fp16 pair 1024 + u of
    nibbles 0 and 4 (bits 0 and 16), and one `fma.rn.f16x2` maps it to (u - 8) * 2**-W_EXP exactly;
    nibbles 1/5 are masked in place (1024 + 16u: an fma by 2**-4 more), 2/6 and 3/7 the same after
    one shift by 8: 9 instructions a word of 8 weights;
  * multiply: nibble J of word i meets column 32c + 4J + i in the kernel layout, so x is paired
    the same way, (x[32c + 4J + i], x[32c + 4J + 16 + i]), converted to fp16 once per thread for all
    its weight rows (X_PAIR_*_ASM), and one `fma.rn.f16x2` a weight pair accumulates;
  * hand-off (DOT_ASM): a thread's 4 words of a chunk (32 columns, always inside one group) chain
    16 fmas in one half2 accumulator, its halves add, and the sum goes to float32 and times the
    group scale: 3 instructions per 32 weights.
Offline sm_90 SASS of the K loop at M = 1 (bf16 x): 2.4 instructions a weight at 16 words a
thread, 3.05 at 8 (the float32 GEMV: 5.1 / 5.8); tests/quant/test_w4a16_f16x2.py holds the counts.

Range and precision. Half2 sums are short (32 products) so that they stay exact enough and in
range: each fp16 product and add rounds at 2**-11 relative (the emulation in the tests measures
5.5e-4 relative from the exact product, against the reference's own 2.1e-3 from its bf16 weight
and output roundings). The weights carry 2**-W_EXP (undone in float32 at the end, exactly) so a
sum cannot overflow: 32 * 8 * |x| * 2**-8 <= 2**15 for |x| <= 2**15, half of fp16's 65504. x is
converted exactly to fp16 for 2**-14 <= |x| <= 65504; below that, and for products below 2**-6,
fp16 subnormals keep an absolute 2**-25 (2**-17 * scale in the output's units). Beyond 65504 (no
bf16 model's linear inputs come near) x becomes inf and so does the output, visibly; between 2**15
and 65504 a sum overflows only if most of a chunk's 32 products are near 8|x| with one sign.
"""
from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from atom_core.kernels.int4_layout import INT4_INTERLEAVE
from atom_core.kernels.triton.tiles import store_gemv_row

W_EXP = 8  # the weights' power-of-two scale 2**-W_EXP (range: the module docstring)
_UNSCALE = tl.constexpr(2.0 ** W_EXP)
NIBBLE_PAIRS = ((0, 4), (1, 5), (2, 6), (3, 7))  # (low half, high half) nibbles of dequant output j
MAGIC = 0x64006400  # fp16 1024.0 twice: OR-ing a nibble into the mantissa gives 1024 + u exactly
LOW_MASK = 0x000F000F  # nibbles 0 and 4 (after the shift: 2 and 6)
HIGH_MASK = 0x00F000F0  # nibbles 1 and 5 (3 and 7): 1024 + 16u
SHIFT = 8  # nibbles 2, 3, 6, 7 move down to 0, 1, 4, 5
LOP3_AND_OR = 0xF0 & 0xCC | 0xAA  # lop3 truth table of (a & b) | c
X_PAIR_LO_PRMT, X_PAIR_HI_PRMT = 0x5410, 0x7632  # prmt selectors: (a.lo, b.lo), (a.hi, b.hi)
# x offsets from nibble 0's column of a word that dequant output j's halves meet (kernel layout: nibble J at 4J)
X_OFFSETS = tuple((lo * INT4_INTERLEAVE, hi * INT4_INTERLEAVE) for lo, hi in NIBBLE_PAIRS)
_XO = tl.constexpr(X_OFFSETS)


def _f16x2(value: float) -> int:
    """The value as two fp16 halves of a 32-bit word (both halves equal)."""
    half = int(np.array(value, dtype=np.float16).view(np.uint16))
    assert float(np.array(half, dtype=np.uint16).view(np.float16)) == value, f"{value} is not exact in fp16"
    return half << 16 | half


# (1024 + u) * 2**-W_EXP - 1032 * 2**-W_EXP and (1024 + 16u) * 2**-(W_EXP + 4) - 72 * 2**-W_EXP: (u - 8) * 2**-W_EXP
LOW_MUL, LOW_ADD = _f16x2(2.0 ** -W_EXP), _f16x2(-1032 * 2.0 ** -W_EXP)
HIGH_MUL, HIGH_ADD = _f16x2(2.0 ** -(W_EXP + 4)), _f16x2(-72 * 2.0 ** -W_EXP)

# word -> 4 f16x2 weight pairs, output j holding nibbles NIBBLE_PAIRS[j]
DEQUANT_ASM = tl.constexpr(f"""{{
.reg .b32 s, lm, la, hm, ha;
mov.b32 lm, {LOW_MUL:#x};
mov.b32 la, {LOW_ADD:#x};
mov.b32 hm, {HIGH_MUL:#x};
mov.b32 ha, {HIGH_ADD:#x};
shr.u32 s, $4, {SHIFT};
lop3.b32 $0, $4, {LOW_MASK:#x}, {MAGIC:#x}, {LOP3_AND_OR:#x};
lop3.b32 $1, $4, {HIGH_MASK:#x}, {MAGIC:#x}, {LOP3_AND_OR:#x};
lop3.b32 $2, s, {LOW_MASK:#x}, {MAGIC:#x}, {LOP3_AND_OR:#x};
lop3.b32 $3, s, {HIGH_MASK:#x}, {MAGIC:#x}, {LOP3_AND_OR:#x};
fma.rn.f16x2 $0, $0, lm, la;
fma.rn.f16x2 $1, $1, hm, ha;
fma.rn.f16x2 $2, $2, lm, la;
fma.rn.f16x2 $3, $3, hm, ha;
}}""")

# (16 weight pairs, 16 x pairs of one chunk) -> the float32 sum of their 32 products: one half2 chain
# of 16 fmas (short: range and precision, above), its halves added in fp16, one convert
_CHAIN = "\n".join(f"fma.rn.f16x2 h, ${1 + p}, ${17 + p}, h;" for p in range(1, 16))
DOT_ASM = tl.constexpr(f"""{{
.reg .b32 h;
.reg .b16 lo, hi;
mul.rn.f16x2 h, $1, $17;
{_CHAIN}
mov.b32 {{lo, hi}}, h;
add.rn.f16 lo, lo, hi;
cvt.f32.f16 $0, lo;
}}""")

# (a0 | a1 << 16, b0 | b1 << 16) 16-bit x values -> f16x2 (a0, b0), (a1, b1). fp16: byte permutes;
# bf16: each value to float32 (shift or mask: no PRMT + shift as Triton's convert), a rounding
# convert a pair (exact in fp16's range; `cvt.rn.f16x2.f32 d, hi, lo` puts its first source high)
X_PAIR_F16_ASM = tl.constexpr(f"""prmt.b32 $0, $2, $3, {X_PAIR_LO_PRMT:#x};
prmt.b32 $1, $2, $3, {X_PAIR_HI_PRMT:#x};""")
X_PAIR_BF16_ASM = tl.constexpr("""{
.reg .b32 a0, a1, b0, b1;
shl.b32 a0, $2, 16;
and.b32 a1, $2, 0xffff0000;
shl.b32 b0, $3, 16;
and.b32 b1, $3, 0xffff0000;
cvt.rn.f16x2.f32 $0, b0, a0;
cvt.rn.f16x2.f32 $1, b1, a1;
}""")

# (BLOCK_N, BLOCK_KW words a step, warps). A thread holds 4-word chunks of BLOCK_N * BLOCK_KW / (128 *
# warps) rows, which share its x conversions: 4 rows (16 words) cost 2.4 instructions a weight at
# M = 1, 2 rows 3.05; 8 rows spill at M = 4. Narrower programs keep 4 rows at N / 8 or N / 16 programs.
GEMV_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_KW": bkw}, num_warps=w, num_stages=1)
    for bn, bkw, w in [(16, 64, 4), (32, 64, 4), (16, 128, 4), (16, 64, 2), (8, 128, 2), (8, 64, 1)]
]


@triton.jit
def _chunk_words(t, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr):
    """[BLOCK_N, BLOCK_KW] -> words 0-3 of each 4-word chunk, [BLOCK_N, BLOCK_KW // 4] each. A
    thread holds whole chunks (16-byte loads), so the splits only pick registers."""
    even, odd = tl.split(tl.reshape(t, (BLOCK_N, BLOCK_KW // 4, 2, 2)))  # word 2p + q at [.., p, q]
    w0, w2 = tl.split(even)
    w1, w3 = tl.split(odd)
    return w0, w1, w2, w3


@triton.jit
def _x_pair(x_ptrs, lo: tl.constexpr, hi: tl.constexpr, k_ok, MASK_K: tl.constexpr):
    """f16x2 (x at x_ptrs + lo, x at x_ptrs + hi) as int32, the low half the first. Two elements an
    asm (pack 2): their 16-bit x values arrive in one register, the first element low."""
    if MASK_K:
        a = tl.load(x_ptrs + lo, mask=k_ok, other=0.0)
        b = tl.load(x_ptrs + hi, mask=k_ok, other=0.0)
    else:
        a = tl.load(x_ptrs + lo)
        b = tl.load(x_ptrs + hi)
    if a.dtype == tl.float16:
        asm: tl.constexpr = X_PAIR_F16_ASM
    else:
        asm: tl.constexpr = X_PAIR_BF16_ASM
    return tl.inline_asm_elementwise(asm, "=r,=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=2)


@triton.jit
def _row_step(acc, w0, w1, w2, w3, x_ptrs, k_ok, scale, MASK_K: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_KW: tl.constexpr):
    """acc [BN, BKW / 4] += scale * (one x row . each chunk's 32 weights); wJ [BN, BKW]: the dequant
    output J (nibbles NIBBLE_PAIRS[J]) of every word. Nibble J of word i meets x column 32c + 4J + i,
    so x pair J is the x tile at X_OFFSETS[J] in the words' layout (4 contiguous columns a thread,
    as w4a16.py). The chain takes (pair J of word i, x pair J of word i) for i, then J."""
    a0, a1, a2, a3 = _chunk_words(w0, BLOCK_N, BLOCK_KW)
    b0, b1, b2, b3 = _chunk_words(w1, BLOCK_N, BLOCK_KW)
    c0, c1, c2, c3 = _chunk_words(w2, BLOCK_N, BLOCK_KW)
    d0, d1, d2, d3 = _chunk_words(w3, BLOCK_N, BLOCK_KW)
    p0, p1, p2, p3 = _chunk_words(_x_pair(x_ptrs, _XO[0][0], _XO[0][1], k_ok, MASK_K), BLOCK_N, BLOCK_KW)
    q0, q1, q2, q3 = _chunk_words(_x_pair(x_ptrs, _XO[1][0], _XO[1][1], k_ok, MASK_K), BLOCK_N, BLOCK_KW)
    r0, r1, r2, r3 = _chunk_words(_x_pair(x_ptrs, _XO[2][0], _XO[2][1], k_ok, MASK_K), BLOCK_N, BLOCK_KW)
    s0, s1, s2, s3 = _chunk_words(_x_pair(x_ptrs, _XO[3][0], _XO[3][1], k_ok, MASK_K), BLOCK_N, BLOCK_KW)
    part = tl.inline_asm_elementwise(
        DOT_ASM, "=r" + ",r" * 32,
        [a0, b0, c0, d0, a1, b1, c1, d1, a2, b2, c2, d2, a3, b3, c3, d3,
         p0, q0, r0, s0, p1, q1, r1, s1, p2, q2, r2, s2, p3, q3, r3, s3],
        dtype=tl.float32, is_pure=True, pack=1)
    return acc + part * scale


@triton.jit(do_not_specialize=["k_split"])
def _w4a16_gemv_f16x2_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, y_ptr, k_split, stride_xm, stride_qn, stride_sn,
                             stride_zn, stride_ym, stride_ys, N, K, M: tl.constexpr, GROUP: tl.constexpr,
                             V: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
                             PARTIAL: tl.constexpr, MASK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_KW: tl.constexpr):
    """w4a16._w4a16_gemv_kernel's contract (same arguments; y, or split-K float32 partials) for V = 4
    and HAS_ZERO false: the same loop over [BLOCK_N, BLOCK_KW] word tiles (the next one prefetched),
    rows past N clamped, columns past K masked; the module's arithmetic, one float32 accumulator
    per chunk and x row, the 2**-W_EXP undone before the row sums."""
    tl.static_assert(V == 4, "the f16x2 GEMV reads the kernel layout (interleave 4) only")
    tl.static_assert(not HAS_ZERO, "the f16x2 GEMV is symmetric (zero 8) only")
    BLOCK_K: tl.constexpr = BLOCK_KW * 8
    split = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(cols, N - 1)
    offs_w = tl.arange(0, BLOCK_KW)
    xcol = (offs_w // 4) * 32 + offs_w % 4  # nibble 0's column of each word
    k_start = split * (k_split // BLOCK_K) * BLOCK_K
    k_end = tl.minimum(k_start + k_split, K)
    w_ptrs = qw_ptr + rows.to(tl.int64)[:, None] * stride_qn + (k_start // 8 + offs_w)[None, :]
    x_ptrs = x_ptr + (k_start + xcol)[None, :] + rows[:, None] * 0  # x in the words' layout (repeats: L1)
    acc0 = tl.zeros([BLOCK_N, BLOCK_KW // 4], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_KW // 4], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_KW // 4], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_KW // 4], dtype=tl.float32)
    if MASK_K:
        words = tl.load(w_ptrs, mask=offs_w[None, :] < (K - k_start) // 8, other=0)
    else:
        words = tl.load(w_ptrs)
    # one x row: two steps an iteration, so the prefetched tile is used where it landed (no 16
    # register moves a step); more rows would spill
    UNROLL: tl.constexpr = 2 if M == 1 else 1
    for k0 in tl.range(k_start, k_end, BLOCK_K, loop_unroll_factor=UNROLL):
        step = tl.where(k0 + BLOCK_K < k_end, BLOCK_KW, 0)  # the last step re-reads its own tile
        if MASK_K:
            words_next = tl.load(w_ptrs + step, mask=offs_w[None, :] < (K - k0) // 8 - step, other=0)
        else:
            words_next = tl.load(w_ptrs + step)
        w0, w1, w2, w3 = tl.inline_asm_elementwise(DEQUANT_ASM, "=r,=r,=r,=r,r", [words], dtype=(tl.int32,) * 4,
                                                   is_pure=True, pack=1)
        # a chunk (32 columns) lies in one group: its scale, loaded in the words' layout, word 0's
        g = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.int32) + ((k0 + xcol) // GROUP)[None, :]
        scale, _, _, _ = _chunk_words(tl.load(s_ptr + rows[:, None] * stride_sn + g), BLOCK_N, BLOCK_KW)
        scale = scale.to(tl.float32)
        k_ok = (k0 + xcol)[None, :] < K
        acc0 = _row_step(acc0, w0, w1, w2, w3, x_ptrs, k_ok, scale, MASK_K, BLOCK_N, BLOCK_KW)
        if M > 1:
            acc1 = _row_step(acc1, w0, w1, w2, w3, x_ptrs + stride_xm, k_ok, scale, MASK_K, BLOCK_N, BLOCK_KW)
        if M > 2:
            acc2 = _row_step(acc2, w0, w1, w2, w3, x_ptrs + 2 * stride_xm, k_ok, scale, MASK_K, BLOCK_N, BLOCK_KW)
        if M > 3:
            acc3 = _row_step(acc3, w0, w1, w2, w3, x_ptrs + 3 * stride_xm, k_ok, scale, MASK_K, BLOCK_N, BLOCK_KW)
        words = words_next
        w_ptrs += step
        x_ptrs += BLOCK_K
    out_ptrs = y_ptr + split * stride_ys + cols
    col_ok = cols < N
    store_gemv_row(tl.sum(acc0 * _UNSCALE, axis=1), b_ptr, out_ptrs, rows, col_ok, HAS_BIAS, PARTIAL)
    if M > 1:
        store_gemv_row(tl.sum(acc1 * _UNSCALE, axis=1), b_ptr, out_ptrs + stride_ym, rows, col_ok, HAS_BIAS,
                       PARTIAL)
    if M > 2:
        store_gemv_row(tl.sum(acc2 * _UNSCALE, axis=1), b_ptr, out_ptrs + 2 * stride_ym, rows, col_ok, HAS_BIAS,
                       PARTIAL)
    if M > 3:
        store_gemv_row(tl.sum(acc3 * _UNSCALE, axis=1), b_ptr, out_ptrs + 3 * stride_ym, rows, col_ok, HAS_BIAS,
                       PARTIAL)


_w4a16_gemv_f16x2_tuned = triton.autotune(configs=GEMV_CONFIGS, key=["M", "N", "K", "GROUP", "V", "HAS_ZERO"])(
    _w4a16_gemv_f16x2_kernel)
