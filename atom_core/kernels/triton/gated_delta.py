"""Gated delta rule (Qwen3-Next / Qwen3.5 linear attention), Triton: a chunked prefill and a fused
recurrent step, over packed sequences with slot-indexed fp32 state pools. Same signatures and
semantics as `kernels.gdn_ref` (read its docstring for the recurrence and the state contract).

Chunked prefill, chunks of CHUNK_SIZE tokens from each sequence's start, in three kernels:
  1. `_gdn_chunk_prep_kernel`, one program per (chunk, v head), all chunks at once: the cumulative
     log-decay G, A = strictly-lower(beta_i (k_i . k_j) exp(G_i - G_j)), T = (I + A)^-1 by forward
     substitution in registers, and the UT-transformed W = T (beta exp(G) k), U = T (beta v).
  2. `_gdn_chunk_state_kernel`, one program per (sequence, v head, v block), the only serial part:
     the state in registers across the sequence's chunks; per chunk it stores the state the chunk
     starts from (H), v_new = U - W S, and S <- exp(G_last) S + (exp(G_last - G) k)^T v_new.
  3. `_gdn_chunk_output_kernel`, one program per (chunk, v head, v block), all chunks at once:
     o = exp(G) q H + causal(q k^T exp(G_i - G_j)) v_new.
Every dot is at most CHUNK_SIZE x 64 x 64: head dims are walked in 64-wide tiles and the state is
held as one [64, BV] tile per 64 key dims, as in flash-linear-attention's kernels, and k^T is loaded
transposed from memory: nothing is transposed in registers. The first version updated its state with
dot(trans(k_tail), v_new), k_tail a register tile: from key width 64 up that dot is a wgmma whose
operand Triton stores to a column-major shared tile and reads back with ldmatrix.trans, and on the
H200 (Triton 3.6) the kernels gave wrong outputs at every such width (illegal memory accesses too at
16 k / 32 v heads), right ones at 16, where the dot is an mma.sync. It also held the state as one
[128, BV] tile (128-row dots, 536 B/thread of register spills) and fused the outputs into the scan.
The recurrent step keeps a state block in registers and walks a sequence's tokens one by one; its
grid depends only on shapes and it never syncs the host, so decode can be captured in a CUDA graph.

Matmul operands are rounded to the input dtype (tensor cores for half inputs) with fp32 accumulation,
and fp32 inputs use IEEE fp32 dots; Triton's interpreter has no working bf16 dot, so there the operands
stay fp32.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from atom_core.kernels.gdn_ref import CHUNK_SIZE, L2NORM_EPS, check_gdn_inputs, check_step_states
from atom_core.kernels.triton.common import check_last_dim_contiguous, check_same_device, next_pow2

_EPS = tl.constexpr(L2NORM_EPS)


@triton.jit
def _dot(a, b, DT: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    """a @ b with both operands rounded to DT (the input dtype), accumulated in fp32; DOT_IN_FP32 (the
    interpreter, bf16) keeps them fp32: the interpreter's bf16 dot returns wrong products (Triton 3.9),
    so the rounded path runs only compiled."""
    if DOT_IN_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a.to(DT), b.to(DT), input_precision=DOT_PRECISION)


@triton.jit
def _load_rows(ptr, rows, row_ok, stride_t, head_off, col0, N: tl.constexpr, BN: tl.constexpr):
    """[BT, BN] fp32 tile of one head: token rows, feature columns col0 .. col0 + BN (0 where masked)."""
    cols = col0 + tl.arange(0, BN)
    return tl.load(ptr + rows.to(tl.int64)[:, None] * stride_t + head_off + cols[None, :],
                   mask=row_ok[:, None] & (cols < N)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _load_cols(ptr, rows, row_ok, stride_t, head_off, col0, N: tl.constexpr, BN: tl.constexpr):
    """The transposed tile, [BN, BT]: loaded so, as the left operand of a k^T dot (no register transpose)."""
    cols = col0 + tl.arange(0, BN)
    return tl.load(ptr + rows.to(tl.int64)[None, :] * stride_t + head_off + cols[:, None],
                   mask=(cols < N)[:, None] & row_ok[None, :], other=0.0).to(tl.float32)


@triton.jit
def _l2norm_factor(sum_sq, USE_L2NORM: tl.constexpr):
    """What l2-normalises rows with these sums of squares (1 without USE_L2NORM). The kernels sum the
    squares over the K tiles they load for their dots anyway, and scale products, not operands, where
    the norm is a factor of the product."""
    if USE_L2NORM:
        return tl.math.rsqrt(sum_sq + _EPS)
    return sum_sq * 0.0 + 1.0


@triton.jit
def _gdn_chunk_prep_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, u_ptr, chunk_bounds_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh, stride_bt, stride_bh,
    GROUP: tl.constexpr, NUM_V_HEADS: tl.constexpr, K_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_L2NORM: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):
    chunk, h = tl.program_id(0), tl.program_id(1)
    DT = k_ptr.dtype.element_ty
    bos = tl.load(chunk_bounds_ptr + 2 * chunk)
    eos = tl.load(chunk_bounds_ptr + 2 * chunk + 1)
    if bos >= eos:  # past the last chunk of the batch
        return
    idx = tl.arange(0, BT)
    rows = bos + idx
    row_ok = rows < eos
    k_off = (h // GROUP) * stride_kh
    g = tl.load(g_ptr + rows.to(tl.int64) * stride_gt + h * stride_gh, mask=row_ok, other=0.0)
    beta = tl.load(beta_ptr + rows.to(tl.int64) * stride_bt + h * stride_bh, mask=row_ok, other=0.0).to(tl.float32)
    cum = tl.cumsum(g, 0)  # masked rows add 0, so every exp below has a non-positive exponent
    kk = tl.zeros([BT, BT], dtype=tl.float32)  # k k^T before the l2 norms
    k_sq = tl.zeros([BT], dtype=tl.float32)
    for k0 in tl.static_range(0, K_DIM, BK):
        kt = _load_rows(k_ptr, rows, row_ok, stride_kt, k_off, k0, K_DIM, BK)
        kk += _dot(kt, _load_cols(k_ptr, rows, row_ok, stride_kt, k_off, k0, K_DIM, BK), DT, DOT_PRECISION,
                   DOT_IN_FP32)
        k_sq += tl.sum(kt * kt, 1)
    k_inv = _l2norm_factor(k_sq, USE_L2NORM)
    lower = idx[:, None] > idx[None, :]
    decay = tl.exp(tl.where(lower, cum[:, None] - cum[None, :], float("-inf")))
    a = (beta * k_inv)[:, None] * kk * k_inv[None, :] * decay  # [BT, BT], zero on and above the diagonal
    # T = (I + A)^-1 row by row: T[i] = e_i - sum_{j<i} A[i, j] T[j] (rows j < i are final by then).
    t_inv = tl.where(idx[:, None] == idx[None, :], 1.0, 0.0)
    for i in range(1, BT):
        a_i = tl.sum(tl.where(idx[:, None] == i, a, 0.0), 0)  # row i of A, over j
        t_i = tl.sum(a_i[:, None] * t_inv, 0)
        t_inv = tl.where(idx[:, None] == i, t_inv - t_i[None, :], t_inv)
    out_rows = rows.to(tl.int64)[:, None] * NUM_V_HEADS + h
    k_scale = k_inv * beta * tl.exp(cum)
    for k0 in tl.static_range(0, K_DIM, BK):
        cols = k0 + tl.arange(0, BK)
        kt = _load_rows(k_ptr, rows, row_ok, stride_kt, k_off, k0, K_DIM, BK) * k_scale[:, None]
        w = _dot(t_inv, kt, DT, DOT_PRECISION, DOT_IN_FP32)
        tl.store(w_ptr + out_rows * K_DIM + cols[None, :], w.to(w_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (cols < K_DIM)[None, :])
    for v0 in tl.static_range(0, V_DIM, BV):
        cols = v0 + tl.arange(0, BV)
        vt = _load_rows(v_ptr, rows, row_ok, stride_vt, h * stride_vh, v0, V_DIM, BV) * beta[:, None]
        u = _dot(t_inv, vt, DT, DOT_PRECISION, DOT_IN_FP32)
        tl.store(u_ptr + out_rows * V_DIM + cols[None, :], u.to(u_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (cols < V_DIM)[None, :])


@triton.jit
def _load_state(state_ptr, slot, h, from_slot, kc, vc, NUM_V_HEADS: tl.constexpr, K_DIM: tl.constexpr,
                V_DIM: tl.constexpr):
    """The [len(kc), len(vc)] fp32 block of head h's state at slot (zeros unless from_slot), and its offsets."""
    offs = ((slot.to(tl.int64) * NUM_V_HEADS + h) * K_DIM + kc[:, None]) * V_DIM + vc[None, :]
    mask = (kc < K_DIM)[:, None] & (vc < V_DIM)[None, :]
    # where(), not &: Triton's interpreter turns a block mask & a scalar bool into integers
    return tl.load(state_ptr + offs, mask=tl.where(from_slot, mask, False), other=0.0), offs, mask


@triton.jit
def _seq_meta(cu_ptr, idx_ptr, has_init_ptr, seq):
    bos = tl.load(cu_ptr + seq).to(tl.int64)
    eos = tl.load(cu_ptr + seq + 1).to(tl.int64)
    slot = tl.load(idx_ptr + seq)
    return bos, eos, slot, (tl.load(has_init_ptr + seq).to(tl.int32) != 0) & (slot >= 0)


@triton.jit
def _store_chunk_state(hs_ptr, chunk, h, kc, vc, s, NUM_V_HEADS: tl.constexpr, K_DIM: tl.constexpr,
                       V_DIM: tl.constexpr):
    """One [len(kc), BV] tile of the state a chunk starts from, into H [chunks, Hv, K, V]."""
    offs = ((chunk * NUM_V_HEADS + h) * K_DIM + kc[:, None]) * V_DIM + vc[None, :]
    tl.store(hs_ptr + offs, s.to(hs_ptr.dtype.element_ty), mask=(kc < K_DIM)[:, None] & (vc < V_DIM)[None, :])


@triton.jit
def _gdn_chunk_state_kernel(
    k_ptr, w_ptr, u_ptr, g_ptr, hs_ptr, v_new_ptr, state_ptr, idx_ptr, cu_ptr, has_init_ptr, first_chunk_ptr,
    stride_kt, stride_kh, stride_gt, stride_gh,
    GROUP: tl.constexpr, NUM_V_HEADS: tl.constexpr, K_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_L2NORM: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):
    """The state as one [BK, BV] tile per BK key dims (s0, and s1 when K_DIM > BK; the wrapper allows two)."""
    seq, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    DT = k_ptr.dtype.element_ty
    bos, eos, slot, from_slot = _seq_meta(cu_ptr, idx_ptr, has_init_ptr, seq)
    if bos >= eos:  # no tokens: the slot stays as it is
        return
    first_chunk = tl.load(first_chunk_ptr + seq).to(tl.int64)
    idx, kc = tl.arange(0, BT), tl.arange(0, BK)
    vc = vb * BV + tl.arange(0, BV)
    k_off = (h // GROUP) * stride_kh
    s0, s0_offs, s0_mask = _load_state(state_ptr, slot, h, from_slot, kc, vc, NUM_V_HEADS, K_DIM, V_DIM)
    if K_DIM > BK:
        s1, s1_offs, s1_mask = _load_state(state_ptr, slot, h, from_slot, BK + kc, vc, NUM_V_HEADS, K_DIM, V_DIM)
    for start in range(bos, eos, BT):
        rows = start + idx
        row_ok = rows < eos
        chunk = first_chunk + (start - bos) // BT
        _store_chunk_state(hs_ptr, chunk, h, kc, vc, s0, NUM_V_HEADS, K_DIM, V_DIM)
        w = _load_rows(w_ptr, rows, row_ok, NUM_V_HEADS * K_DIM, h * K_DIM, 0, K_DIM, BK)
        ws = _dot(w, s0, DT, DOT_PRECISION, DOT_IN_FP32)  # [BT, BV]
        if K_DIM > BK:
            _store_chunk_state(hs_ptr, chunk, h, BK + kc, vc, s1, NUM_V_HEADS, K_DIM, V_DIM)
            w = _load_rows(w_ptr, rows, row_ok, NUM_V_HEADS * K_DIM, h * K_DIM, BK, K_DIM, BK)
            ws += _dot(w, s1, DT, DOT_PRECISION, DOT_IN_FP32)
        u_offs = (rows.to(tl.int64)[:, None] * NUM_V_HEADS + h) * V_DIM + vc[None, :]
        uv_mask = row_ok[:, None] & (vc < V_DIM)[None, :]
        v_new = tl.load(u_ptr + u_offs, mask=uv_mask, other=0.0).to(tl.float32) - ws
        tl.store(v_new_ptr + u_offs, v_new.to(v_new_ptr.dtype.element_ty), mask=uv_mask)
        g = tl.load(g_ptr + rows * stride_gt + h * stride_gh, mask=row_ok, other=0.0)
        cum = tl.cumsum(g, 0)
        cum_last = tl.sum(g, 0)
        kt0 = _load_cols(k_ptr, rows, row_ok, stride_kt, k_off, 0, K_DIM, BK)  # [BK, BT]
        k_sq = tl.sum(kt0 * kt0, 0)
        if K_DIM > BK:
            kt1 = _load_cols(k_ptr, rows, row_ok, stride_kt, k_off, BK, K_DIM, BK)
            k_sq += tl.sum(kt1 * kt1, 0)
        # (k_j * n_j)^T v_j = k_j^T (n_j v_j): the norms scale v_new's rows; masked rows are 0 already
        v_tail = v_new * (tl.exp(cum_last - cum) * _l2norm_factor(k_sq, USE_L2NORM))[:, None]
        s0 = s0 * tl.exp(cum_last) + _dot(kt0, v_tail, DT, DOT_PRECISION, DOT_IN_FP32)
        if K_DIM > BK:
            s1 = s1 * tl.exp(cum_last) + _dot(kt1, v_tail, DT, DOT_PRECISION, DOT_IN_FP32)
    if slot >= 0:
        tl.store(state_ptr + s0_offs, s0, mask=s0_mask)
        if K_DIM > BK:
            tl.store(state_ptr + s1_offs, s1, mask=s1_mask)


@triton.jit
def _gdn_chunk_output_kernel(
    q_ptr, k_ptr, v_new_ptr, hs_ptr, g_ptr, o_ptr, chunk_bounds_ptr, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_gt, stride_gh, stride_ot, stride_oh,
    GROUP: tl.constexpr, NUM_V_HEADS: tl.constexpr, K_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_L2NORM: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):
    chunk, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    DT = k_ptr.dtype.element_ty
    bos = tl.load(chunk_bounds_ptr + 2 * chunk)
    eos = tl.load(chunk_bounds_ptr + 2 * chunk + 1)
    if bos >= eos:
        return
    idx, kc = tl.arange(0, BT), tl.arange(0, BK)
    vc = vb * BV + tl.arange(0, BV)
    rows = bos + idx
    row_ok = rows < eos
    q_off, k_off = (h // GROUP) * stride_qh, (h // GROUP) * stride_kh
    qh = tl.zeros([BT, BV], dtype=tl.float32)  # q H and q k^T before the l2 norms
    qk = tl.zeros([BT, BT], dtype=tl.float32)
    q_sq = tl.zeros([BT], dtype=tl.float32)
    k_sq = tl.zeros([BT], dtype=tl.float32)
    for k0 in tl.static_range(0, K_DIM, BK):
        q = _load_rows(q_ptr, rows, row_ok, stride_qt, q_off, k0, K_DIM, BK)
        kt = _load_cols(k_ptr, rows, row_ok, stride_kt, k_off, k0, K_DIM, BK)  # [BK, BT]
        hs = tl.load(hs_ptr + ((chunk.to(tl.int64) * NUM_V_HEADS + h) * K_DIM + k0 + kc[:, None]) * V_DIM
                     + vc[None, :], mask=(k0 + kc < K_DIM)[:, None] & (vc < V_DIM)[None, :], other=0.0)
        qh += _dot(q, hs, DT, DOT_PRECISION, DOT_IN_FP32)
        qk += _dot(q, kt, DT, DOT_PRECISION, DOT_IN_FP32)
        q_sq += tl.sum(q * q, 1)
        k_sq += tl.sum(kt * kt, 0)
    q_scale = _l2norm_factor(q_sq, USE_L2NORM) * scale
    g = tl.load(g_ptr + rows.to(tl.int64) * stride_gt + h * stride_gh, mask=row_ok, other=0.0)
    cum = tl.cumsum(g, 0)
    causal = idx[:, None] >= idx[None, :]
    decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
    attn = q_scale[:, None] * qk * _l2norm_factor(k_sq, USE_L2NORM)[None, :] * decay
    v_new = tl.load(v_new_ptr + (rows.to(tl.int64)[:, None] * NUM_V_HEADS + h) * V_DIM + vc[None, :],
                    mask=row_ok[:, None] & (vc < V_DIM)[None, :], other=0.0)
    o = qh * (q_scale * tl.exp(cum))[:, None] + _dot(attn, v_new, DT, DOT_PRECISION, DOT_IN_FP32)
    tl.store(o_ptr + rows.to(tl.int64)[:, None] * stride_ot + h * stride_oh + vc[None, :],
             o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & (vc < V_DIM)[None, :])


@triton.jit
def _gdn_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, idx_ptr, cu_ptr, has_init_ptr, step_ptr, step_idx_ptr,
    scale, num_steps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh, stride_bt, stride_bh,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, NUM_V_HEADS: tl.constexpr, K_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_L2NORM: tl.constexpr, HAS_STEPS: tl.constexpr,
):
    seq, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos, slot, from_slot = _seq_meta(cu_ptr, idx_ptr, has_init_ptr, seq)
    if bos >= eos:
        return
    if HAS_STEPS:
        step_row = tl.load(step_idx_ptr + seq).to(tl.int64)
    kc = tl.arange(0, BK)
    vc = vb * BV + tl.arange(0, BV)
    k_ok, v_ok = kc < K_DIM, vc < V_DIM
    s, s_offs, s_mask = _load_state(state_ptr, slot, h, from_slot, kc, vc, NUM_V_HEADS, K_DIM, V_DIM)
    for t in range(bos, eos):
        q = tl.load(q_ptr + t * stride_qt + (h // GROUP) * stride_qh + kc, mask=k_ok, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * stride_kt + (h // GROUP) * stride_kh + kc, mask=k_ok, other=0.0).to(tl.float32)
        if USE_L2NORM:
            q = q * tl.math.rsqrt(tl.sum(q * q, 0) + _EPS)
            k = k * tl.math.rsqrt(tl.sum(k * k, 0) + _EPS)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + vc, mask=v_ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * stride_gt + h * stride_gh)
        beta = tl.load(beta_ptr + t * stride_bt + h * stride_bh).to(tl.float32)
        s = s * tl.exp(g)
        u = (v - tl.sum(s * k[:, None], 0)) * beta
        s = s + k[:, None] * u[None, :]
        o = tl.sum(s * (q * scale)[:, None], 0)
        tl.store(o_ptr + t * stride_ot + h * stride_oh + vc, o.to(o_ptr.dtype.element_ty), mask=v_ok)
        if HAS_STEPS:  # the state after this token, in the step pool [rows, num_steps, Hv, Dk, Dv]
            step = t - bos
            if (step_row >= 0) & (step < num_steps):
                step_offs = s_offs + (step_row * num_steps + step - slot.to(tl.int64)) * (NUM_V_HEADS * K_DIM * V_DIM)
                tl.store(step_ptr + step_offs, s, mask=s_mask)
    if slot >= 0:
        tl.store(state_ptr + s_offs, s, mask=s_mask)


_INTERPRETED = not isinstance(_gdn_chunk_state_kernel, triton.runtime.jit.JITFunction)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check(q, k, v, g, beta, state, state_indices, cu_seqlens, has_initial_state) -> None:
    check_gdn_inputs(q, k, v, g, beta, state, state_indices, cu_seqlens, has_initial_state)
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q, k, v must share one float dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_last_dim_contiguous(name, t)
    if not state.is_contiguous():
        raise ValueError("state must be a contiguous pool")
    check_same_device(q=q, k=k, v=v, g=g, beta=beta, state=state, state_indices=state_indices,
                      cu_seqlens=cu_seqlens, has_initial_state=has_initial_state)


def _dot_kwargs(dtype: torch.dtype) -> dict:
    return dict(DOT_PRECISION="ieee" if dtype == torch.float32 else None,
                DOT_IN_FP32=_INTERPRETED and dtype == torch.bfloat16)


# One warpgroup (4 warps) a program: the dots have CHUNK_SIZE = 64 rows, one wgmma's M. At 8 warps
# Triton's sm_90 compile gave 64-row dots an [8, 1] warp layout (two warpgroups over 64 rows); the
# sm_90 compile test in test_gdn_triton.py checks that every dot's warp layout fits its tile.
CHUNK_NUM_WARPS = 4
# The state kernel holds the state as one [CHUNK_TILE_K, BV] tile per CHUNK_TILE_K key dims, two at most.
CHUNK_TILE_K = 64
CHUNK_MAX_K_DIM = 2 * CHUNK_TILE_K


class ChunkShapes(NamedTuple):
    """Block sizes of the three chunk kernels for one head shape (the sm_90 compile test uses them too)."""
    block_k: int  # K tile of every kernel
    prep_block_v: int  # V tile of U = T (beta v)
    state_block_v: int  # v block of a state program: narrow, for more programs on the serial part
    output_block_v: int


def chunk_shapes(k_dim: int, v_dim: int) -> ChunkShapes:
    block_v = max(16, next_pow2(v_dim))
    return ChunkShapes(block_k=min(CHUNK_TILE_K, max(16, next_pow2(k_dim))), prep_block_v=min(64, block_v),
                       state_block_v=min(32, block_v), output_block_v=min(64, block_v))


def chunk_constexprs(num_k_heads: int, num_v_heads: int, k_dim: int, v_dim: int, dtype: torch.dtype,
                     use_qk_l2norm: bool) -> dict:
    """The constexprs the three chunk kernels share, BV aside."""
    return dict(GROUP=num_v_heads // num_k_heads, NUM_V_HEADS=num_v_heads, K_DIM=k_dim, V_DIM=v_dim,
                BT=CHUNK_SIZE, BK=chunk_shapes(k_dim, v_dim).block_k, USE_L2NORM=use_qk_l2norm,
                **_dot_kwargs(dtype))


class ChunkLayout(NamedTuple):
    bounds: torch.Tensor  # [max_chunks, 2] int32 (start, end) token rows of every chunk; unused tail (0, 0)
    first_chunk: torch.Tensor  # [N] int32 index of each sequence's first chunk in bounds


def chunk_layout(cu_seqlens: torch.Tensor, num_tokens: int) -> ChunkLayout:
    """Every chunk of the batch, numbered sequence by sequence, on the device and without a host sync;
    max_chunks = T // CHUNK_SIZE + N bounds sum(ceil(len_i / CHUNK_SIZE))."""
    num_seqs = cu_seqlens.shape[0] - 1
    max_chunks = num_tokens // CHUNK_SIZE + num_seqs
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    seq_chunks = (lens + CHUNK_SIZE - 1) // CHUNK_SIZE
    chunk_ends = torch.cumsum(seq_chunks, 0)  # [N] chunks up to each sequence's end
    ids = torch.arange(max_chunks, device=cu.device)
    seq = torch.searchsorted(chunk_ends, ids, right=True).clamp_max(num_seqs - 1)
    first = chunk_ends - seq_chunks
    start = cu[seq] + (ids - first[seq]) * CHUNK_SIZE
    valid = ids < chunk_ends[-1]
    end = torch.minimum(start + CHUNK_SIZE, cu[seq + 1])
    bounds = torch.stack([torch.where(valid, start, 0), torch.where(valid, end, 0)], 1)
    return ChunkLayout(bounds.to(torch.int32).contiguous(), first.to(torch.int32))


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor, cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor,
    *, scale: float, use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """Prefill; see kernels.gdn_ref.chunk_gated_delta_rule. Returns o [T, Hv, Dv] in v's dtype. Key
    heads up to CHUNK_MAX_K_DIM wide run the chunked kernels, wider ones the recurrent kernel (same
    contract)."""
    rule = chunked_gated_delta_rule if q.shape[-1] <= CHUNK_MAX_K_DIM else fused_recurrent_gated_delta_rule
    return rule(q, k, v, g, beta, state, state_indices, cu_seqlens, has_initial_state, scale=scale,
                use_qk_l2norm=use_qk_l2norm)


def chunked_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor, cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor,
    *, scale: float, use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """The chunked (WY / UT) prefill: the prep kernel, the state scan, then the outputs."""
    return chunk_stages(q, k, v, g, beta, state, state_indices, cu_seqlens, has_initial_state, scale=scale,
                        use_qk_l2norm=use_qk_l2norm).out


class ChunkStages(NamedTuple):
    """What each chunk kernel wrote (the stage tests compare each with its torch counterpart)."""
    w: torch.Tensor  # [T, Hv, Dk] prep: T (beta exp(G) k)
    u: torch.Tensor  # [T, Hv, Dv] prep: T (beta v)
    chunk_states: torch.Tensor  # [max_chunks, Hv, Dk, Dv] state scan: the state each chunk starts from
    v_new: torch.Tensor  # [T, Hv, Dv] state scan: U - W S
    out: torch.Tensor  # [T, Hv, Dv] outputs


def chunk_stages(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor, cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor,
    *, scale: float, use_qk_l2norm: bool = True,
) -> ChunkStages:
    """chunked_gated_delta_rule, keeping the intermediates; rows outside every sequence are unwritten.
    The chunk states take max_chunks * Hv * Dk * Dv elements of q's dtype (16 KiB a token in bf16 at
    Qwen3-Next's 32 x 128 x 128), for the step."""
    _check(q, k, v, g, beta, state, state_indices, cu_seqlens, has_initial_state)
    num_tokens, num_k_heads, k_dim = q.shape
    num_v_heads, v_dim = v.shape[1:]
    if k_dim > CHUNK_MAX_K_DIM:
        raise ValueError(f"the chunked kernels take key heads up to {CHUNK_MAX_K_DIM} wide, got {k_dim}")
    num_seqs = state_indices.shape[0]
    layout = chunk_layout(cu_seqlens, num_tokens) if num_tokens and num_seqs else None
    num_chunks = 0 if layout is None else layout.bounds.shape[0]
    w = torch.empty((num_tokens, num_v_heads, k_dim), dtype=q.dtype, device=q.device)
    u = torch.empty((num_tokens, num_v_heads, v_dim), dtype=q.dtype, device=q.device)
    stages = ChunkStages(w, u, torch.empty((num_chunks, num_v_heads, k_dim, v_dim), dtype=q.dtype, device=q.device),
                         torch.empty_like(u), torch.zeros(v.shape, dtype=v.dtype, device=v.device))
    if layout is None:
        return stages
    shapes = chunk_shapes(k_dim, v_dim)
    consts = chunk_constexprs(num_k_heads, num_v_heads, k_dim, v_dim, q.dtype, use_qk_l2norm)
    launch = dict(num_warps=CHUNK_NUM_WARPS, num_stages=2)
    _gdn_chunk_prep_kernel[(num_chunks, num_v_heads)](
        k, v, g, beta, w, u, layout.bounds, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), BV=shapes.prep_block_v, **consts, **launch,
    )
    _gdn_chunk_state_kernel[(num_seqs, num_v_heads, triton.cdiv(v_dim, shapes.state_block_v))](
        k, w, u, g, stages.chunk_states, stages.v_new, state, state_indices, cu_seqlens, has_initial_state,
        layout.first_chunk, k.stride(0), k.stride(1), g.stride(0), g.stride(1), BV=shapes.state_block_v, **consts,
        **launch,
    )
    out = stages.out
    _gdn_chunk_output_kernel[(num_chunks, num_v_heads, triton.cdiv(v_dim, shapes.output_block_v))](
        q, k, stages.v_new, stages.chunk_states, g, out, layout.bounds, scale, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), g.stride(0), g.stride(1), out.stride(0), out.stride(1), BV=shapes.output_block_v,
        **consts, **launch,
    )
    return stages


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor, cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor,
    *, scale: float, use_qk_l2norm: bool = True, step_state: torch.Tensor | None = None,
    step_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token-by-token step for 1..few tokens a sequence (decode, drafts, verify steps, which keep the
    state after each token in step_state); see kernels.gdn_ref.fused_recurrent_gated_delta_rule.
    Grid from shapes only: CUDA-graph safe."""
    _check(q, k, v, g, beta, state, state_indices, cu_seqlens, has_initial_state)
    check_step_states(step_state, step_indices, state_indices, state.shape[1:])
    if step_state is not None:
        check_same_device(state=state, step_state=step_state, step_indices=step_indices)
        if not step_state.is_contiguous():
            raise ValueError("step_state must be contiguous")
    num_k_heads, k_dim = q.shape[1:]
    num_v_heads, v_dim = v.shape[1:]
    out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    num_seqs = state_indices.shape[0]
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    block_v = min(32, max(16, next_pow2(v_dim)))
    _gdn_recurrent_kernel[(num_seqs, num_v_heads, triton.cdiv(v_dim, block_v))](
        q, k, v, g, beta, out, state, state_indices, cu_seqlens, has_initial_state,
        state if step_state is None else step_state, state_indices if step_indices is None else step_indices,
        scale, 0 if step_state is None else step_state.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1),
        beta.stride(0), beta.stride(1), out.stride(0), out.stride(1),
        GROUP=num_v_heads // num_k_heads, NUM_V_HEADS=num_v_heads, K_DIM=k_dim, V_DIM=v_dim,
        BK=next_pow2(k_dim), BV=block_v, USE_L2NORM=use_qk_l2norm, HAS_STEPS=step_state is not None,
        num_warps=4,
    )
    return out
