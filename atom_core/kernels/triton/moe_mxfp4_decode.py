"""MXFP4 fused MoE for decode (few (token, slot) assignments): two GEMV kernels, no tl.dot, no
alignment launch. `moe_mxfp4.fused_moe_mxfp4` dispatches here when T * top_k <= GEMV_MAX_ASSIGNMENTS.

Why: at batch 1 the tl.dot path pads each expert's one row to a 16-row tile and round-trips the
decoded tile through shared memory for the MMA operands, so it runs at a small fraction of HBM
bandwidth (measured: see docs/PERFORMANCE.md). Here each program owns rows of
one expert and streams their packed bytes once, in registers:

- GEMM1 `_gemv1_kernel`: program (row block rb, assignment a = t*K + k), BLOCK_N gate rows and the
  same BLOCK_N up rows of expert topk_ids[a], all of H. The grid puts the assignments of one row
  block next to each other, so assignments sharing an expert read the same bytes at about the same
  time (the duplicates can come from L2). An assignment with an id outside [0, E) returns.
- GEMM2 `_gemv2_kernel`: program (row block rb, token t), BLOCK_N rows of H for all K of t's
  experts at once (a [BLOCK_N, K, ...] tile, one warp per k), so the sum over top-k is in
  registers, in a fixed order (deterministic), and no sum launch is needed; dropped ids are
  masked (no bytes read).

Inner loop, per BLOCK_K columns: the bytes load as uint32 words [rows, G, 4] (G = BLOCK_K / 32
groups), a word a thread, a warp reading 128 contiguous bytes of a row. Word j of group g holds the
8 values 32g + 8j + c, c = 0..7, as nibble c (byte c//2, low nibble first). Each nibble becomes a
float32 by bit placement: magnitude bits to bits 22-24, sign to bit 31, i.e. the e2m1 value times
2^-126 (the 0.5 a subnormal, exact): one AND isolates two nibbles 16 bits apart, one integer
multiply per value puts both copies of its nibble in place, one AND keeps them (`_place`); then one
FFMA with the activation. The activations are pre-scaled by 2^X_SHIFT so the products stay normal
floats; the e8m0 scale 2^(s-127) multiplies each word's 8-value sum (per group, not per value), and
the float32 accumulator is multiplied by 2^(126 - X_SHIFT) once at the end (exact powers of two).
The next BLOCK_K's bytes and scales are loaded before the current ones are decoded (a register
double buffer). GEMM1 writes act in float32 (the activation rounded to hidden's dtype, as the
reference does, times 2^X_SHIFT), which GEMM2 reads without conversion.

Offline sm_90 SASS (ptxas), inner loop: ~6.2 instructions a weight for GEMM1 (72 registers),
~6.7 for GEMM2 (55 registers). On gpt-oss-20b shapes the call is faster than the tiled path at
M = 1, 4 and 8, though still above its bytes floor (measured: see docs/PERFORMANCE.md).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from atom_core.kernels.triton.moe_common import activate  # the tiled paths' activation (the same codes)

# T * top_k up to this runs the GEMVs (top-4 decode batches up to 8 tokens). The GEMVs decode every
# assignment's weights, the tiled path each expert's once: the GEMVs win at M*K = 32 on both
# gpt-oss models; at 64, 20b's 32 experts repeat (so the tiled path reads fewer bytes) and tiled
# wins, while 120b's 128 rarely repeat (measured: see docs/PERFORMANCE.md).
GEMV_MAX_ASSIGNMENTS = 32
X_SHIFT = tl.constexpr(64)  # activations times 2^64: e2m1 * 2^-126 products stay normal floats
# Tiles: the fastest of a sweep on gpt-oss-20b shapes at M = 1 and 8 (see docs/PERFORMANCE.md)
GEMV1_TILE = (8, 128, 1)  # BLOCK_N (gate rows, and as many up rows), BLOCK_K, num_warps
GEMV2_TILE = (8, 128)  # BLOCK_N, BLOCK_K; one warp per top-k slot


@triton.jit
def _place(m, MULT: tl.constexpr):
    """float32 of the nibble that MULT moves to bits 22-25 (and a copy to bits 28-31) of m: the
    magnitude bits land on 22-24 and the sign on 31, i.e. the e2m1 value times 2^-126 (exact, 0.5
    a subnormal). m holds two isolated nibbles 16 bits apart, the other one's copies fall outside
    those bits (below 16 or past bit 31), and no two copies overlap, so the sum has no carries."""
    return ((m * MULT) & 0x81C00000).to(tl.float32, bitcast=True)


@triton.jit
def _x(x_ptrs, C: tl.constexpr, x_mask, X_SCALE: tl.constexpr):
    x = tl.load(x_ptrs + C, mask=x_mask, other=0.0).to(tl.float32)
    if X_SCALE:
        x = x * (2.0 ** X_SHIFT)
    return x


@triton.jit
def _words_dot(w, x_ptrs, x_mask, X_SCALE: tl.constexpr):
    """Per uint32 word of w [..., G, 4], the sum over its 8 values of x * e2m1 * 2^-126; value c
    (nibble c, byte c//2, low nibble first) multiplies x at x_ptrs + c. Nibbles c and c + 4 are
    isolated together (one AND), then placed by one multiply each (`_place`)."""
    lo = w & 0x000F000F  # nibbles 0, 4
    part = _place(lo, (1 << 22) + (1 << 28)) * _x(x_ptrs, 0, x_mask, X_SCALE)
    part += _place(lo, (1 << 6) + (1 << 12)) * _x(x_ptrs, 4, x_mask, X_SCALE)
    lo = w & 0x00F000F0  # nibbles 1, 5
    part += _place(lo, (1 << 18) + (1 << 24)) * _x(x_ptrs, 1, x_mask, X_SCALE)
    part += _place(lo, (1 << 2) + (1 << 8)) * _x(x_ptrs, 5, x_mask, X_SCALE)
    hi = (w >> 8) & 0x000F000F  # nibbles 2, 6
    part += _place(hi, (1 << 22) + (1 << 28)) * _x(x_ptrs, 2, x_mask, X_SCALE)
    part += _place(hi, (1 << 6) + (1 << 12)) * _x(x_ptrs, 6, x_mask, X_SCALE)
    hi = (w >> 8) & 0x00F000F0  # nibbles 3, 7
    part += _place(hi, (1 << 18) + (1 << 24)) * _x(x_ptrs, 3, x_mask, X_SCALE)
    part += _place(hi, (1 << 2) + (1 << 8)) * _x(x_ptrs, 7, x_mask, X_SCALE)
    return part


@triton.jit
def _scale_mult(s):
    """e8m0 bytes -> 2^(s-127) as float32 (s = 0: the subnormal 2^-127)."""
    s = s.to(tl.uint32)
    return tl.where(s == 0, 0x400000, s << 23).to(tl.float32, bitcast=True)


# Every tensor of the inner loop is [..., G, 4] (group, word) in one layout, a word a thread: the
# weights load as single words (the expert stride is not specialized, so the compiler cannot prove
# 16-byte alignment and emits no vector loads, which would give the weights a layout of their own),
# the 8 activations of a word's nibbles and its group's scale (the same byte for the 4 words of a
# group) load into the same places, and the accumulator keeps that shape: no layout conversion
# (shared memory, barriers) and no cross-thread sum inside the loop. The row strides are constexpr,
# so a thread's rows share one address register (immediate offsets).
_NOT_SPECIALIZED = ["num_experts", "stride_we", "stride_sg"]


@triton.jit(do_not_specialize=["num_assignments", "limit"] + _NOT_SPECIALIZED)
def _gemv1_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, ids_ptr, act_ptr, num_assignments, num_experts, limit,
    stride_xt, stride_we, stride_se, stride_sg, stride_be, stride_at, stride_wn: tl.constexpr, stride_sn: tl.constexpr,
    INTER: tl.constexpr, HIDDEN: tl.constexpr, TOP_K: tl.constexpr, ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """act[a, n] = 2^X_SHIFT * act(x[t] @ w13[e].T + b13[e])[n] for BLOCK_N columns n of I,
    a = t*K + k, e = topk_ids[a]. w strides in uint32 words."""
    pid = tl.program_id(0)
    a = pid % num_assignments
    rb = pid // num_assignments
    expert = tl.load(ids_ptr + a)
    if (expert < 0) | (expert >= num_experts):
        return
    expert = expert.to(tl.int64)
    token = (a // TOP_K).to(tl.int64)
    G: tl.constexpr = BLOCK_K // 32
    rows = tl.minimum(rb * BLOCK_N + tl.arange(0, BLOCK_N), INTER - 1)[:, None, None]  # past I: never stored
    offs_g = tl.arange(0, G)[None, :, None]
    offs_j = tl.arange(0, 4)[None, None, :]
    g_ptrs = w_ptr.to(tl.pointer_type(tl.uint32)) + expert * stride_we + rows * stride_wn + offs_g * 4 + offs_j
    u_ptrs = g_ptrs + INTER * stride_wn
    gs_ptrs = s_ptr + expert * stride_se + rows * stride_sn + offs_g * stride_sg + offs_j * 0
    us_ptrs = gs_ptrs + INTER * stride_sn
    x_ptrs = x_ptr + token * stride_xt + offs_g * 32 + offs_j * 8
    acc_g = tl.zeros([BLOCK_N, G, 4], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, G, 4], dtype=tl.float32)
    ok = offs_g < HIDDEN // 32
    wg = tl.load(g_ptrs, mask=ok, other=0)
    wu = tl.load(u_ptrs, mask=ok, other=0)
    sg = tl.load(gs_ptrs, mask=ok, other=0)
    su = tl.load(us_ptrs, mask=ok, other=0)
    for k0 in range(0, HIDDEN, BLOCK_K):
        next_ok = k0 + BLOCK_K + offs_g * 32 < HIDDEN  # the next tile's bytes fly while this one decodes
        wg_next = tl.load(g_ptrs + BLOCK_K // 8, mask=next_ok, other=0)
        wu_next = tl.load(u_ptrs + BLOCK_K // 8, mask=next_ok, other=0)
        sg_next = tl.load(gs_ptrs + G * stride_sg, mask=next_ok, other=0)
        su_next = tl.load(us_ptrs + G * stride_sg, mask=next_ok, other=0)
        acc_g += _words_dot(wg, x_ptrs, ok, True) * _scale_mult(sg)
        acc_u += _words_dot(wu, x_ptrs, ok, True) * _scale_mult(su)
        wg, wu, sg, su, ok = wg_next, wu_next, sg_next, su_next, next_ok
        g_ptrs += BLOCK_K // 8
        u_ptrs += BLOCK_K // 8
        gs_ptrs += G * stride_sg
        us_ptrs += G * stride_sg
        x_ptrs += BLOCK_K
    gate = tl.sum(tl.sum(acc_g, axis=2), axis=1) * (2.0 ** (126 - X_SHIFT))
    up = tl.sum(tl.sum(acc_u, axis=2), axis=1) * (2.0 ** (126 - X_SHIFT))
    cols = rb * BLOCK_N + tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        gate += tl.load(bias_ptr + expert * stride_be + cols, mask=cols < INTER, other=0.0).to(tl.float32)
        up += tl.load(bias_ptr + expert * stride_be + INTER + cols, mask=cols < INTER, other=0.0).to(tl.float32)
    act = activate(gate, up, limit, ACTIVATION)
    act = act.to(x_ptr.dtype.element_ty).to(tl.float32) * (2.0 ** X_SHIFT)  # rounded as the reference does
    tl.store(act_ptr + a.to(tl.int64) * stride_at + cols, act, mask=cols < INTER)


@triton.jit(do_not_specialize=["num_tokens"] + _NOT_SPECIALIZED)
def _gemv2_kernel(
    act_ptr, w_ptr, s_ptr, bias_ptr, topk_weights_ptr, ids_ptr, out_ptr, num_tokens, num_experts,
    stride_at, stride_we, stride_se, stride_sg, stride_be, stride_ot, stride_wn: tl.constexpr, stride_sn: tl.constexpr,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, K_P: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[t, n] = sum_k topk_weight[t, k] * (act[t*K + k] @ w2[e_k].T + b2[e_k])[n] for BLOCK_N
    columns n of H, summed over k in order in float32. w strides in uint32 words."""
    pid = tl.program_id(0)
    token = pid % num_tokens
    rb = pid // num_tokens
    G: tl.constexpr = BLOCK_K // 32
    offs_k = tl.arange(0, K_P)
    flat = token * TOP_K + offs_k
    expert = tl.load(ids_ptr + flat, mask=offs_k < TOP_K, other=-1)
    k_ok = (offs_k < TOP_K) & (expert >= 0) & (expert < num_experts)
    expert = tl.where(k_ok, expert, 0).to(tl.int64)
    cols = rb * BLOCK_N + tl.arange(0, BLOCK_N)
    # [rows, k, group, word]: the warps split the k (the rows' x is then shared in registers)
    rows = tl.minimum(cols, HIDDEN - 1)[:, None, None, None]
    e4 = expert[None, :, None, None]
    k_ok4 = k_ok[None, :, None, None]
    offs_g = tl.arange(0, G)[None, None, :, None]
    offs_j = tl.arange(0, 4)[None, None, None, :]
    w_ptrs = w_ptr.to(tl.pointer_type(tl.uint32)) + e4 * stride_we + rows * stride_wn + offs_g * 4 + offs_j
    s_ptrs = s_ptr + e4 * stride_se + rows * stride_sn + offs_g * stride_sg + offs_j * 0
    x_ptrs = act_ptr + flat.to(tl.int64)[None, :, None, None] * stride_at + offs_g * 32 + offs_j * 8
    acc = tl.zeros([BLOCK_N, K_P, G, 4], dtype=tl.float32)
    ok = k_ok4 & (offs_g < INTER // 32)
    w = tl.load(w_ptrs, mask=ok, other=0)
    s = tl.load(s_ptrs, mask=ok, other=0)
    for k0 in range(0, INTER, BLOCK_K):
        next_ok = k_ok4 & (k0 + BLOCK_K + offs_g * 32 < INTER)
        w_next = tl.load(w_ptrs + BLOCK_K // 8, mask=next_ok, other=0)
        s_next = tl.load(s_ptrs + G * stride_sg, mask=next_ok, other=0)
        acc += _words_dot(w, x_ptrs, ok, False) * _scale_mult(s)
        w, s, ok = w_next, s_next, next_ok
        w_ptrs += BLOCK_K // 8
        s_ptrs += G * stride_sg
        x_ptrs += BLOCK_K
    y = tl.sum(tl.sum(acc, axis=3), axis=2) * (2.0 ** (126 - X_SHIFT))  # [BLOCK_N, K_P]; act carries 2^X_SHIFT
    if HAS_BIAS:
        y += tl.load(bias_ptr + expert[None, :] * stride_be + tl.minimum(cols, HIDDEN - 1)[:, None]).to(tl.float32)
    weight = tl.load(topk_weights_ptr + flat, mask=k_ok, other=0.0)
    y = tl.where(k_ok[None, :], y * weight[None, :], 0.0)
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + cols, tl.sum(y, axis=1).to(out_ptr.dtype.element_ty),
             mask=cols < HIDDEN)


def can_use_gemv(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """The GEMV kernels read the packed bytes as uint32 words: 4-byte aligned rows."""
    return all(t.data_ptr() % 4 == 0 and t.stride(0) % 4 == 0 and t.stride(1) % 4 == 0 for t in (w13, w2))


def fused_moe_mxfp4_gemv(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H/2] uint8
    w13_scale: torch.Tensor,  # [E, 2I, H/32] uint8
    w2: torch.Tensor,  # [E, H, I/2] uint8
    w2_scale: torch.Tensor,  # [E, H, I/32] uint8
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int
    activation_code: int,
    w13_bias: Optional[torch.Tensor],
    w2_bias: Optional[torch.Tensor],
    swiglu_limit: Optional[float],
    out: torch.Tensor,  # [T, H]
) -> torch.Tensor:
    """Arguments already checked by `moe_mxfp4.fused_moe_mxfp4` (and `can_use_gemv`). Two launches,
    grids from host ints only, no host sync (CUDA-graph safe)."""
    num_tokens, hidden_size = hidden.shape
    num_experts, inter, top_k = w13.shape[0], w13.shape[1] // 2, topk_ids.shape[1]
    num_assignments = num_tokens * top_k
    act = torch.empty((num_assignments, inter), dtype=torch.float32, device=hidden.device)
    bn1, bk1, warps1 = GEMV1_TILE
    _gemv1_kernel[(num_assignments * triton.cdiv(inter, bn1),)](
        hidden, w13, w13_scale, w13_bias if w13_bias is not None else hidden, topk_ids, act, num_assignments,
        num_experts, float(swiglu_limit or 0.0), hidden.stride(0), w13.stride(0) // 4, w13_scale.stride(0),
        w13_scale.stride(2), w13_bias.stride(0) if w13_bias is not None else 0, act.stride(0),
        stride_wn=w13.stride(1) // 4, stride_sn=w13_scale.stride(1),
        INTER=inter, HIDDEN=hidden_size, TOP_K=top_k, ACTIVATION=activation_code,
        HAS_BIAS=w13_bias is not None, BLOCK_N=bn1, BLOCK_K=bk1, num_warps=warps1, num_stages=1,
    )
    bn2, bk2 = GEMV2_TILE
    k_p = triton.next_power_of_2(top_k)
    _gemv2_kernel[(num_tokens * triton.cdiv(hidden_size, bn2),)](
        act, w2, w2_scale, w2_bias if w2_bias is not None else hidden, topk_weights, topk_ids, out, num_tokens,
        num_experts, act.stride(0), w2.stride(0) // 4, w2_scale.stride(0), w2_scale.stride(2),
        w2_bias.stride(0) if w2_bias is not None else 0, out.stride(0), stride_wn=w2.stride(1) // 4,
        stride_sn=w2_scale.stride(1),
        HIDDEN=hidden_size, INTER=inter, TOP_K=top_k, K_P=k_p, HAS_BIAS=w2_bias is not None, BLOCK_N=bn2,
        BLOCK_K=bk2, num_warps=k_p, num_stages=1,
    )
    return out
