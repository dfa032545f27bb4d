"""Fused MoE over MXFP4 expert weights (Triton): the GEMMs read the packed e2m1 bytes and e8m0
scales and dequantize in the inner loop, so a decode step reads 4.25 bits per weight.

Same pipeline and contracts as `kernels/triton/moe.py` (alignment by expert, GEMM1 with the
activation in its epilogue, GEMM2 weighting rows by their top-k weight, a float32 sum over the
K rows of each token), whose alignment, tile order and sum it reuses. Oracle:
`quant/mxfp4.fused_moe_mxfp4_ref` (same signature). Weight layout (see quant/mxfp4.py):
w13 uint8 [E, 2I, H/2] (gate rows, then up rows), w13_scale uint8 [E, 2I, H/32], w2 uint8
[E, H, I/2], w2_scale uint8 [E, H, I/32]; byte j of a row holds values 2j (low nibble) and 2j+1.

Inner loop, per BLOCK_K columns of K: the weight tile is loaded as [BLOCK_K/32 groups, 16 bytes,
BLOCK_N rows] with its [groups, BLOCK_N] scales; each nibble becomes float32 by bit placement
(sign to bit 31, the 3 magnitude bits to bits 24-22: e2m1 read as a float32 2^-126 too small,
so one multiply by 2^126 restores it, subnormal 0.5 included) and one multiply by the scale
2^(s-127) (float32 bits s << 23; s = 0 is the subnormal 2^-127): the product HF's `ldexp`
computes, rounded once to the activations' dtype. The low nibbles multiply the even columns of
x and the high nibbles the odd ones: two dots of BLOCK_K/2, no interleaving shuffle. Both
accumulate in float32. Epilogue: bias, then silu(gate) * up or GPT-OSS's swigluoai
((up + 1) * gate * sigmoid(1.702 gate), gate clamped above at the limit, up to +-limit).

Decode batches (T * top_k <= 32) take the GEMV kernels of `moe_mxfp4_decode` instead (no tile
padding, no alignment launch; faster than this path at batch 1, see docs/PERFORMANCE.md); the
tiled path below still serves them when a config or path="tiled" is given.

Decode on the tiled path (M = 1 to a few tokens, each expert's rows one BLOCK_M=16 block): narrow N tiles (32 rows
of gate and 32 of up; 32 of H) give ~360 programs per GEMM on GPT-OSS-20b's shapes (I = H = 2880,
top-4), all resident at once (BLOCK_K 128 keeps them at ~100 registers, 5-6 programs an SM), so
every SM streams weights with 3 stages of copies in flight. Offline SASS counts (sm_90, ptxas) of
the inner loop: ~5 instructions a weight for GEMM1, ~6 for GEMM2; at that rate an sm_90 SM's
issue width covers about as many weights a clock as HBM delivers, so decode sits near the bytes
floor only if issue and loads overlap well.
"""
from __future__ import annotations

from typing import Literal, Optional

import torch
import triton
import triton.language as tl

from atom_core.kernels.moe_ref import check_activation
from atom_core.kernels.triton.common import check_dim, check_float, check_same_device
from atom_core.kernels.triton.moe import moe_align_block_size, moe_sum
from atom_core.kernels.triton.moe_common import (
    ACTIVATIONS, GemmTile, MoeConfig, activate, check_routing, dot_args, gemm1_tile, gemm2_tile, grouped_tile,
    store_aligned_rows, store_weighted_rows,
)
from atom_core.kernels.triton.tiles import INTERPRETED
from atom_core.kernels.triton.moe_mxfp4_decode import GEMV_MAX_ASSIGNMENTS, can_use_gemv, fused_moe_mxfp4_gemv

MX_GROUP = 32  # values per scale
TWO_POW_126 = tl.constexpr(2.0 ** 126)  # a Triton global must be a constexpr


# e2m1 -> bf16 on NVIDIA GPUs, 4 bytes (8 values) per call: bytes 0/1 and 2/3 are spread to the two
# 16-bit halves of a word (prmt), then each nibble's magnitude bits go to bits 6-8 (the bf16
# exponent's two low bits and the mantissa's top bit: e2m1 read as a bf16 2^126 too small, 0.5 a
# subnormal) and its sign to bit 15; one bf16x2 multiply (fma with -0.0: sm_80 has no bf16x2 mul)
# by the scale gives the value, rounded once. $0 $1: low nibbles of bytes 0-1 and 2-3, $2 $3: high
# nibbles; $4: the 4 bytes; $5 $6: the scales of bytes 0-1 and 2-3 (bf16x2).
def _e2m1_pair_ptx(out: str, word: str, shift: int, scale: str) -> str:
    """One output register's lines: the two nibbles of `word` whose magnitude bits reach bits 6-8
    shifted left by `shift` (6: the low nibbles, 2: the high ones), their signs at bit 15, times `scale`."""
    return f"""shl.b32 m, {word}, {shift};
shl.b32 s, {word}, {shift + 6};
and.b32 m, m, 0x01C001C0;
and.b32 s, s, 0x80008000;
or.b32 {out}, m, s;
fma.rn.bf16x2 {out}, {out}, {scale}, nz;
"""


_E2M1_BF16_PTX = tl.constexpr("""
{
.reg .b32 t<2>, m, s, nz;
mov.b32 nz, 0x80008000;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
""" + _e2m1_pair_ptx("$0", "t0", 6, "$5") + _e2m1_pair_ptx("$1", "t1", 6, "$6")
    + _e2m1_pair_ptx("$2", "t0", 2, "$5") + _e2m1_pair_ptx("$3", "t1", 2, "$6") + "}\n")
# The PTX decode's values are 2^-PTX_SHIFT of the true ones: the scale multiply then also undoes
# the 2^-126 (2^(s-127) * 2^126 * 2^-63 = 2^(s-64) fits bf16 for every s <= 191, where 2^(s-1)
# would overflow past s = 128), and the GEMMs multiply their float32 sums by 2^PTX_SHIFT (exact).
# Every product is then exact, as in HF, for exponents s in [65, 191] (|values| from 2^-62 to 2^65;
# checkpoints hold s near 100-135); below, values flush towards 0, above they are clamped.
PTX_SHIFT = tl.constexpr(63)


@triton.jit
def _dequant(packed, scales, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, OUT_DTYPE: tl.constexpr,
             BF16_PTX: tl.constexpr):
    """packed uint8 [G, 16, BLOCK_N] (G = BLOCK_K / 32), scales uint8 [G, BLOCK_N] -> the values of the
    even (low nibble) and odd (high nibble) columns, each [BLOCK_K / 2, BLOCK_N] in OUT_DTYPE.
    BF16_PTX (NVIDIA, bf16 out): the inline-PTX decode (4 instructions a value), values scaled by
    2^-PTX_SHIFT; else portable float32 arithmetic (interpreter, ROCm, fp16/fp32), exact values."""
    s = scales.to(tl.uint32)
    if BF16_PTX:
        # bf16 bits of 2^(s - 127 + 126 - PTX_SHIFT) = 2^(s - 64): exponent field s + 63
        scale = (tl.minimum(s, 191) + (126 - PTX_SHIFT)) << 7
        scale = scale.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        scale = tl.broadcast_to(scale[:, None, :], [BLOCK_K // 32, 16, BLOCK_N])
        lo, hi = tl.inline_asm_elementwise(_E2M1_BF16_PTX, "=r,=r,=r,=r,r,r,r", [packed, scale],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        p = packed.to(tl.uint32)
        # 2^(s-127) as float32 bits s << 23; s = 0 is the subnormal 2^-127
        scale = tl.where(s == 0, 0x400000, s << 23).to(tl.float32, bitcast=True)[:, None, :]
        lo = (((p & 0x7) << 22) | ((p & 0x8) << 28)).to(tl.float32, bitcast=True) * TWO_POW_126 * scale
        hi = (((p & 0x70) << 18) | ((p & 0x80) << 24)).to(tl.float32, bitcast=True) * TWO_POW_126 * scale
        lo = lo.to(OUT_DTYPE)
        hi = hi.to(OUT_DTYPE)
    return tl.reshape(lo, [BLOCK_K // 2, BLOCK_N]), tl.reshape(hi, [BLOCK_K // 2, BLOCK_N])


@triton.jit
def _weight_ptrs(w_ptr, s_ptr, expert, offs_n, stride_we, stride_wn, stride_se, stride_sn,
                 BLOCK_K: tl.constexpr):
    """Pointers of one [G, 16, BLOCK_N] byte tile and its [G, BLOCK_N] scales at K = 0."""
    offs_g = tl.arange(0, BLOCK_K // 32)
    offs_b = tl.arange(0, 16)
    w_ptrs = (w_ptr + expert * stride_we + offs_n[None, None, :] * stride_wn
              + (offs_g[:, None, None] * 16 + offs_b[None, :, None]))
    s_ptrs = s_ptr + expert * stride_se + offs_n[None, :] * stride_sn + offs_g[:, None]
    return w_ptrs, s_ptrs


@triton.jit
def _load_tile(w_ptrs, s_ptrs, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, MASKED: tl.constexpr):
    """One K step of bytes and scales; K is a multiple of 32, so whole groups are in or out."""
    if MASKED:
        g_ok = k0 + tl.arange(0, BLOCK_K // 32) * 32 < K
        packed = tl.load(w_ptrs, mask=g_ok[:, None, None], other=0)
        scales = tl.load(s_ptrs, mask=g_ok[:, None], other=0)
    else:
        packed = tl.load(w_ptrs)
        scales = tl.load(s_ptrs)
    return packed, scales


@triton.jit
def _load_pairs(a_ptrs, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, MASKED: tl.constexpr):
    """Even and odd columns [rows, BLOCK_K / 2] of the activation tile at a_ptrs [rows, BLOCK_K]."""
    if MASKED:
        a = tl.load(a_ptrs, mask=(k0 + tl.arange(0, BLOCK_K) < K)[None, :], other=0.0)
    else:
        a = tl.load(a_ptrs)
    return tl.split(tl.reshape(a, [a.shape[0], BLOCK_K // 2, 2]))


@triton.jit
def _dot_pair(acc, a_even, a_odd, lo, hi, DOT_IN_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    if DOT_IN_FP32:
        a_even, a_odd, lo, hi = a_even.to(tl.float32), a_odd.to(tl.float32), lo.to(tl.float32), hi.to(tl.float32)
    acc = tl.dot(a_even, lo, acc, input_precision=DOT_PRECISION)
    return tl.dot(a_odd, hi, acc, input_precision=DOT_PRECISION)


@triton.jit
def _gemm1_step(acc_g, acc_u, a_ptrs, g_ptrs, gs_ptrs, u_ptrs, us_ptrs, k0, K: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_IN_FP32: tl.constexpr,
                DOT_PRECISION: tl.constexpr, BF16_PTX: tl.constexpr):
    a_even, a_odd = _load_pairs(a_ptrs, k0, K, BLOCK_K, MASKED)
    wg, sg = _load_tile(g_ptrs, gs_ptrs, k0, K, BLOCK_K, MASKED)
    wu, su = _load_tile(u_ptrs, us_ptrs, k0, K, BLOCK_K, MASKED)
    g_lo, g_hi = _dequant(wg, sg, BLOCK_K, BLOCK_N, a_even.dtype, BF16_PTX)
    u_lo, u_hi = _dequant(wu, su, BLOCK_K, BLOCK_N, a_even.dtype, BF16_PTX)
    acc_g = _dot_pair(acc_g, a_even, a_odd, g_lo, g_hi, DOT_IN_FP32, DOT_PRECISION)
    acc_u = _dot_pair(acc_u, a_even, a_odd, u_lo, u_hi, DOT_IN_FP32, DOT_PRECISION)
    return acc_g, acc_u


@triton.jit(do_not_specialize=["num_assignments", "num_m_blocks", "limit"])
def _gemm1_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
    num_assignments, num_m_blocks, limit, stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_be,
    stride_ot, INTER: tl.constexpr, HIDDEN: tl.constexpr, TOP_K: tl.constexpr, ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_IN_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BF16_PTX: tl.constexpr,
):
    """act(x[tokens] @ w13[e].T + b13[e]) for BLOCK_M aligned rows x BLOCK_N columns of I."""
    pid_m, pid_n, past_end = grouped_tile(num_m_blocks, num_post_ptr, INTER, BLOCK_M, BLOCK_N, GROUP_M)
    if past_end:
        return
    rows, token, expert, cols, offs_n = gemm1_tile(pid_m, pid_n, sorted_ptr, expert_ids_ptr, num_assignments, INTER,
                                                   TOP_K, BLOCK_M, BLOCK_N)
    g_ptrs, gs_ptrs = _weight_ptrs(w_ptr, s_ptr, expert, offs_n, stride_we, stride_wn, stride_se, stride_sn, BLOCK_K)
    u_ptrs = g_ptrs + INTER * stride_wn
    us_ptrs = gs_ptrs + INTER * stride_sn
    a_ptrs = x_ptr + token[:, None] * stride_xt + tl.arange(0, BLOCK_K)[None, :]
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, HIDDEN - HIDDEN % BLOCK_K, BLOCK_K):  # whole tiles, unmasked
        acc_g, acc_u = _gemm1_step(acc_g, acc_u, a_ptrs, g_ptrs, gs_ptrs, u_ptrs, us_ptrs, k0, HIDDEN, BLOCK_K,
                                   BLOCK_N, False, DOT_IN_FP32, DOT_PRECISION, BF16_PTX)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K // 2
        u_ptrs += BLOCK_K // 2
        gs_ptrs += BLOCK_K // 32
        us_ptrs += BLOCK_K // 32
    if HIDDEN % BLOCK_K != 0:  # the tail tile
        acc_g, acc_u = _gemm1_step(acc_g, acc_u, a_ptrs, g_ptrs, gs_ptrs, u_ptrs, us_ptrs,
                                   HIDDEN - HIDDEN % BLOCK_K, HIDDEN, BLOCK_K, BLOCK_N, True, DOT_IN_FP32,
                                   DOT_PRECISION, BF16_PTX)
    if BF16_PTX:
        acc_g *= 2.0 ** PTX_SHIFT
        acc_u *= 2.0 ** PTX_SHIFT
    if HAS_BIAS:
        b_ptrs = bias_ptr + expert * stride_be + offs_n
        acc_g += tl.load(b_ptrs).to(tl.float32)[None, :]
        acc_u += tl.load(b_ptrs + INTER).to(tl.float32)[None, :]
    act = activate(acc_g, acc_u, limit, ACTIVATION)
    store_aligned_rows(out_ptr, act, rows, cols, stride_ot, INTER)


@triton.jit
def _gemm2_step(acc, a_ptrs, w_ptrs, ws_ptrs, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                MASKED: tl.constexpr, DOT_IN_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
                BF16_PTX: tl.constexpr):
    a_even, a_odd = _load_pairs(a_ptrs, k0, K, BLOCK_K, MASKED)
    w, s = _load_tile(w_ptrs, ws_ptrs, k0, K, BLOCK_K, MASKED)
    lo, hi = _dequant(w, s, BLOCK_K, BLOCK_N, a_even.dtype, BF16_PTX)
    return _dot_pair(acc, a_even, a_odd, lo, hi, DOT_IN_FP32, DOT_PRECISION)


@triton.jit(do_not_specialize=["num_assignments", "num_m_blocks"])
def _gemm2_kernel(
    a_ptr, w_ptr, s_ptr, bias_ptr, topk_weights_ptr, out_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
    num_assignments, num_m_blocks, stride_at, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_ot,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BF16_PTX: tl.constexpr,
):
    """topk_weight * (act[rows] @ w2[e].T + b2[e]) for BLOCK_M aligned rows x BLOCK_N columns of H,
    stored at the rows' flat ids t*K + k."""
    pid_m, pid_n, past_end = grouped_tile(num_m_blocks, num_post_ptr, HIDDEN, BLOCK_M, BLOCK_N, GROUP_M)
    if past_end:
        return
    rows, flat, row_ok, expert, cols, offs_n = gemm2_tile(pid_m, pid_n, sorted_ptr, expert_ids_ptr, num_assignments,
                                                          HIDDEN, BLOCK_M, BLOCK_N)
    w_ptrs, ws_ptrs = _weight_ptrs(w_ptr, s_ptr, expert, offs_n, stride_we, stride_wn, stride_se, stride_sn, BLOCK_K)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_at + tl.arange(0, BLOCK_K)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, INTER - INTER % BLOCK_K, BLOCK_K):
        acc = _gemm2_step(acc, a_ptrs, w_ptrs, ws_ptrs, k0, INTER, BLOCK_K, BLOCK_N, False, DOT_IN_FP32,
                          DOT_PRECISION, BF16_PTX)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // 2
        ws_ptrs += BLOCK_K // 32
    if INTER % BLOCK_K != 0:
        acc = _gemm2_step(acc, a_ptrs, w_ptrs, ws_ptrs, INTER - INTER % BLOCK_K, INTER, BLOCK_K, BLOCK_N, True,
                          DOT_IN_FP32, DOT_PRECISION, BF16_PTX)
    if BF16_PTX:
        acc *= 2.0 ** PTX_SHIFT
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + offs_n).to(tl.float32)[None, :]
    store_weighted_rows(out_ptr, acc, topk_weights_ptr, flat, row_ok, cols, stride_ot, HIDDEN)


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, out_ptr, num_rows, stride_wr, stride_sr, stride_or,
                    K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BF16_PTX: tl.constexpr):
    """out [rows, K] = the values of packed rows [rows, K/2] (the GEMMs' decode, for tests)."""
    r0 = tl.program_id(0) * BLOCK_R
    k0 = tl.program_id(1) * BLOCK_K
    offs_r = r0 + tl.arange(0, BLOCK_R)
    rows = tl.minimum(offs_r, num_rows - 1).to(tl.int64)
    w_ptrs, s_ptrs = _weight_ptrs(w_ptr + k0 // 2, s_ptr + k0 // 32, 0, rows, 0, stride_wr, 0, stride_sr, BLOCK_K)
    packed, scales = _load_tile(w_ptrs, s_ptrs, k0, K, BLOCK_K, K % BLOCK_K != 0)
    lo, hi = _dequant(packed, scales, BLOCK_K, BLOCK_R, out_ptr.dtype.element_ty, BF16_PTX)
    if BF16_PTX:  # undo the decode's 2^-PTX_SHIFT as the GEMMs do (exact in float32)
        lo = (lo.to(tl.float32) * 2.0 ** PTX_SHIFT).to(tl.bfloat16)
        hi = (hi.to(tl.float32) * 2.0 ** PTX_SHIFT).to(tl.bfloat16)
    cols = k0 + 2 * tl.arange(0, BLOCK_K // 2)
    ptrs = out_ptr + rows[None, :] * stride_or + cols[:, None]
    mask = (offs_r < num_rows)[None, :] & (cols < K)[:, None]
    tl.store(ptrs, lo, mask=mask)
    tl.store(ptrs + 1, hi, mask=mask)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[rows, K/2] uint8 blocks and [rows, K/32] uint8 scales -> [rows, K] in `dtype`, with the
    GEMMs' inner-loop decode (so tests can check its bits against HF's dequantization)."""
    check_dim("blocks", blocks, 2)
    check_dim("scales", scales, 2)
    num_rows, k = blocks.shape[0], blocks.shape[1] * 2
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or scales.shape != (num_rows, k // MX_GROUP) \
            or k % MX_GROUP or blocks.stride(1) != 1 or scales.stride(1) != 1:
        raise ValueError(f"need uint8 blocks [rows, K/2] and scales [rows, K/32] (K a multiple of {MX_GROUP}, "
                         f"last dims contiguous), got {blocks.dtype} {tuple(blocks.shape)} and {scales.dtype} "
                         f"{tuple(scales.shape)}")
    check_same_device(blocks=blocks, scales=scales)
    out = torch.empty((num_rows, k), dtype=dtype, device=blocks.device)
    block_r, block_k = 16, min(256, 1 << (k - 1).bit_length())
    _dequant_kernel[(triton.cdiv(num_rows, block_r), triton.cdiv(k, block_k))](
        blocks, scales, out, num_rows, blocks.stride(0), scales.stride(0), out.stride(0),
        K=k, BLOCK_R=block_r, BLOCK_K=block_k, BF16_PTX=_bf16_ptx(dtype), num_warps=1,
    )
    return out


def _dot_args(dtype: torch.dtype) -> dict:
    return {**dot_args(dtype), "BF16_PTX": _bf16_ptx(dtype)}


def _bf16_ptx(dtype: torch.dtype) -> bool:
    """The inline-PTX decode: NVIDIA GPUs (not ROCm, not the interpreter), bf16 activations."""
    return dtype == torch.bfloat16 and not INTERPRETED and torch.version.hip is None


def default_mxfp4_config(num_tokens: int, top_k: int, num_experts: int) -> MoeConfig:
    """Tiles by the average rows per expert (untuned; the tiers of moe.py's default, with the
    narrow decode N tiles the packed weights want, see the module docstring)."""
    rows_per_expert = num_tokens * top_k / num_experts
    if rows_per_expert <= 8:  # decode: weight-bandwidth bound
        return MoeConfig(16, GemmTile(32, 128, 1, 4, 3), GemmTile(32, 128, 1, 4, 3))
    if rows_per_expert <= 32:
        return MoeConfig(32, GemmTile(64, 128, 1, 4, 3), GemmTile(64, 128, 1, 4, 3))
    if rows_per_expert <= 128:
        return MoeConfig(64, GemmTile(64, 128, 4, 4, 3), GemmTile(128, 128, 4, 4, 3))
    return MoeConfig(128, GemmTile(64, 128, 8, 8, 3), GemmTile(128, 128, 8, 8, 3))


MoePath = Literal["auto", "gemv", "tiled"]


def select_path(num_tokens: int, top_k: int, config: MoeConfig | None = None, path: MoePath = "auto") -> str:
    """'gemv' (moe_mxfp4_decode: per-assignment GEMVs, no alignment) for decode-sized batches,
    T * top_k <= GEMV_MAX_ASSIGNMENTS, unless a tile config is given; else 'tiled' (the tl.dot path)."""
    if path not in ("auto", "gemv", "tiled"):
        raise ValueError(f"unknown MXFP4 MoE path {path!r}; expected one of: auto, gemv, tiled")
    if path != "auto":
        return path
    return "gemv" if config is None and num_tokens * top_k <= GEMV_MAX_ASSIGNMENTS else "tiled"


def _check_args(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, activation, w13_bias, w2_bias,
                swiglu_limit) -> None:
    check_activation(activation, swiglu_limit)
    check_dim("hidden", hidden, 2)
    check_float("hidden", hidden)
    for name, t in (("w13", w13), ("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
        check_dim(name, t, 3)
        if t.dtype != torch.uint8:
            raise ValueError(f"{name} must be uint8 (packed e2m1 / e8m0 bytes), got {t.dtype}")
        if t.stride(2) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    num_tokens, hidden_size = hidden.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    if hidden_size % MX_GROUP or inter % MX_GROUP:
        raise ValueError(f"MXFP4 needs H and I multiples of {MX_GROUP}, got H={hidden_size}, I={inter}")
    expect = {"w13": (num_experts, 2 * inter, hidden_size // 2),
              "w13_scale": (num_experts, 2 * inter, hidden_size // 32),
              "w2": (num_experts, hidden_size, inter // 2), "w2_scale": (num_experts, hidden_size, inter // 32)}
    for name, t in (("w13", w13), ("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
        if tuple(t.shape) != expect[name]:
            raise ValueError(f"{name} must be {list(expect[name])} for H={hidden_size}, I={inter}, E={num_experts}, "
                             f"got {tuple(t.shape)}")
    check_routing(topk_weights, topk_ids, num_tokens)
    if hidden.stride(1) != 1:
        raise ValueError(f"hidden must be contiguous in its last dim, got strides {hidden.stride()}")
    for name, t, shape in (("w13_bias", w13_bias, (num_experts, 2 * inter)), ("w2_bias", w2_bias,
                                                                              (num_experts, hidden_size))):
        if t is not None:
            if tuple(t.shape) != shape or t.stride(1) != 1:
                raise ValueError(f"{name} must be {list(shape)}, contiguous in its last dim, got {tuple(t.shape)}")
            check_float(name, t)
    check_same_device(hidden=hidden, w13=w13, w13_scale=w13_scale, w2=w2, w2_scale=w2_scale,
                      topk_weights=topk_weights, topk_ids=topk_ids)


def fused_moe_mxfp4(
    hidden: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str = "silu",
    w13_bias: Optional[torch.Tensor] = None, w2_bias: Optional[torch.Tensor] = None,
    swiglu_limit: Optional[float] = None, *, config: MoeConfig | None = None, path: MoePath = "auto",
) -> torch.Tensor:
    """Same contract as `quant.mxfp4.fused_moe_mxfp4_ref`; no host sync (CUDA-graph safe).
    `select_path` picks the kernels: decode batches run the two GEMVs of moe_mxfp4_decode (the sum
    over top-k fused, in float32), larger ones five launches of the tiled path (each weighted expert
    output rounded once, their sum in float32). Both: float32 accumulation, the activation in
    float32 rounded once to hidden's dtype."""
    _check_args(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, activation, w13_bias, w2_bias,
                swiglu_limit)
    out = torch.empty_like(hidden)
    num_tokens, hidden_size = hidden.shape
    num_experts, inter, top_k = w13.shape[0], w13.shape[1] // 2, topk_ids.shape[1]
    if num_tokens == 0:
        return out
    if select_path(num_tokens, top_k, config, path) == "gemv" and can_use_gemv(w13, w2):
        return fused_moe_mxfp4_gemv(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids,
                                    ACTIVATIONS[activation], w13_bias, w2_bias, swiglu_limit, out)
    cfg = config or default_mxfp4_config(num_tokens, top_k, num_experts)
    for tile in (cfg.gemm1, cfg.gemm2):
        if tile.block_k < MX_GROUP or tile.block_k & (tile.block_k - 1):
            raise ValueError(f"MXFP4 tiles need block_k a power of two >= {MX_GROUP}, got {tile.block_k}")
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, cfg.block_m, num_experts)
    num_m = triton.cdiv(sorted_ids.shape[0], cfg.block_m)
    act = hidden.new_empty((sorted_ids.shape[0], inter))
    t1 = cfg.gemm1
    _gemm1_kernel[(num_m * triton.cdiv(inter, t1.block_n),)](
        hidden, w13, w13_scale, w13_bias if w13_bias is not None else hidden, act, sorted_ids, expert_ids, num_post,
        num_tokens * top_k, num_m, float(swiglu_limit or 0.0), hidden.stride(0), w13.stride(0), w13.stride(1),
        w13_scale.stride(0), w13_scale.stride(1), w13_bias.stride(0) if w13_bias is not None else 0, act.stride(0),
        INTER=inter, HIDDEN=hidden_size, TOP_K=top_k, ACTIVATION=ACTIVATIONS[activation],
        HAS_BIAS=w13_bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=t1.block_n, BLOCK_K=t1.block_k,
        GROUP_M=t1.group_m, num_warps=t1.num_warps, num_stages=t1.num_stages, **_dot_args(hidden.dtype),
    )
    partial = hidden.new_empty((num_tokens * top_k, hidden_size))
    t2 = cfg.gemm2
    _gemm2_kernel[(num_m * triton.cdiv(hidden_size, t2.block_n),)](
        act, w2, w2_scale, w2_bias if w2_bias is not None else hidden, topk_weights, partial, sorted_ids, expert_ids,
        num_post, num_tokens * top_k, num_m, act.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0),
        w2_scale.stride(1), w2_bias.stride(0) if w2_bias is not None else 0, partial.stride(0),
        HIDDEN=hidden_size, INTER=inter, HAS_BIAS=w2_bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=t2.block_n,
        BLOCK_K=t2.block_k, GROUP_M=t2.group_m, num_warps=t2.num_warps, num_stages=t2.num_stages,
        **_dot_args(hidden.dtype),
    )
    return moe_sum(partial, topk_ids, num_experts, out)
