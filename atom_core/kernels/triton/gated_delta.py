"""Gated delta rule (Qwen3-Next / Qwen3.5 linear attention), Triton: a chunked prefill and a fused
recurrent step, over packed sequences with slot-indexed fp32 state pools. Same signatures and
semantics as `kernels.gdn_ref` (read its docstring for the recurrence and the state contract).

Chunked prefill, chunks of CHUNK_SIZE tokens from each sequence's start:
  1. `_gdn_chunk_prep_kernel`, one program per (chunk, v head), all chunks at once: the cumulative
     log-decay G, A = strictly-lower(beta_i (k_i . k_j) exp(G_i - G_j)), T = (I + A)^-1 by forward
     substitution in registers, and the UT-transformed W = T (beta exp(G) k), U = T (beta v).
  2. `_gdn_chunk_scan_kernel`, one program per (sequence, v head, v block): the state block in
     registers across the sequence's chunks; per chunk v_new = U - W S, the output
     exp(G) q S + causal(q k^T exp(G_i - G_j)) v_new, and S <- exp(G_last) S + (exp(G_last - G) k)^T v_new.
The recurrent step keeps a state block in registers and walks a sequence's tokens one by one; its
grid depends only on shapes and it never syncs the host, so decode can be captured in a CUDA graph.

Matmul operands are rounded to the input dtype (tensor cores for half inputs) with fp32 accumulation,
and fp32 inputs use IEEE fp32 dots; Triton's interpreter has no working bf16 dot, so there the operands
stay fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_core.kernels.gdn_ref import CHUNK_SIZE, L2NORM_EPS, check_gdn_inputs
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
def _load_qk(ptr, rows, row_ok, stride_t, head_off, cols, col_ok, USE_L2NORM: tl.constexpr):
    """[BT, BK] fp32 rows of one head, l2-normalised when asked; masked rows and columns are 0."""
    x = tl.load(ptr + rows.to(tl.int64)[:, None] * stride_t + head_off + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    if USE_L2NORM:
        x = x * tl.math.rsqrt(tl.sum(x * x, 1) + _EPS)[:, None]
    return x


@triton.jit(do_not_specialize=["num_chunks"])
def _gdn_chunk_prep_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, u_ptr, chunk_bounds_ptr, num_chunks,
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
    kc, vc = tl.arange(0, BK), tl.arange(0, BV)
    k = _load_qk(k_ptr, rows, row_ok, stride_kt, (h // GROUP) * stride_kh, kc, kc < K_DIM, USE_L2NORM)
    v = tl.load(v_ptr + rows.to(tl.int64)[:, None] * stride_vt + h * stride_vh + vc[None, :],
                mask=row_ok[:, None] & (vc < V_DIM)[None, :], other=0.0).to(tl.float32)
    g = tl.load(g_ptr + rows.to(tl.int64) * stride_gt + h * stride_gh, mask=row_ok, other=0.0)
    beta = tl.load(beta_ptr + rows.to(tl.int64) * stride_bt + h * stride_bh, mask=row_ok, other=0.0).to(tl.float32)
    cum = tl.cumsum(g, 0)  # masked rows add 0, so every exp below has a non-positive exponent
    lower = idx[:, None] > idx[None, :]
    decay = tl.exp(tl.where(lower, cum[:, None] - cum[None, :], float("-inf")))
    # [BT, BT], zero on and above the diagonal
    a = beta[:, None] * _dot(k, tl.trans(k), DT, DOT_PRECISION, DOT_IN_FP32) * decay
    # T = (I + A)^-1 row by row: T[i] = e_i - sum_{j<i} A[i, j] T[j] (rows j < i are final by then).
    t_inv = tl.where(idx[:, None] == idx[None, :], 1.0, 0.0)
    for i in range(1, BT):
        a_i = tl.sum(tl.where(idx[:, None] == i, a, 0.0), 0)  # row i of A, over j
        t_i = tl.sum(a_i[:, None] * t_inv, 0)
        t_inv = tl.where(idx[:, None] == i, t_inv - t_i[None, :], t_inv)
    w = _dot(t_inv, k * (beta * tl.exp(cum))[:, None], DT, DOT_PRECISION, DOT_IN_FP32)
    u = _dot(t_inv, v * beta[:, None], DT, DOT_PRECISION, DOT_IN_FP32)
    out_rows = rows.to(tl.int64)[:, None] * NUM_V_HEADS + h
    tl.store(w_ptr + out_rows * K_DIM + kc[None, :], w.to(w_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (kc < K_DIM)[None, :])
    tl.store(u_ptr + out_rows * V_DIM + vc[None, :], u.to(u_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (vc < V_DIM)[None, :])


@triton.jit
def _load_state(state_ptr, slot, h, from_slot, kc, vc, NUM_V_HEADS: tl.constexpr, K_DIM: tl.constexpr,
                V_DIM: tl.constexpr):
    """The [BK, BV] fp32 block of head h's state at slot (zeros unless from_slot), and its offsets."""
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
def _gdn_chunk_scan_kernel(
    q_ptr, k_ptr, w_ptr, u_ptr, g_ptr, o_ptr, state_ptr, idx_ptr, cu_ptr, has_init_ptr, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_gt, stride_gh, stride_ot, stride_oh,
    GROUP: tl.constexpr, NUM_V_HEADS: tl.constexpr, K_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_L2NORM: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):
    seq, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    DT = k_ptr.dtype.element_ty
    bos, eos, slot, from_slot = _seq_meta(cu_ptr, idx_ptr, has_init_ptr, seq)
    if bos >= eos:  # no tokens: the slot stays as it is
        return
    idx, kc = tl.arange(0, BT), tl.arange(0, BK)
    vc = vb * BV + tl.arange(0, BV)
    k_ok, v_ok = kc < K_DIM, vc < V_DIM
    s, s_offs, s_mask = _load_state(state_ptr, slot, h, from_slot, kc, vc, NUM_V_HEADS, K_DIM, V_DIM)
    causal = idx[:, None] >= idx[None, :]
    for start in range(bos, eos, BT):
        rows = start + idx
        row_ok = rows < eos
        q = _load_qk(q_ptr, rows, row_ok, stride_qt, (h // GROUP) * stride_qh, kc, k_ok, USE_L2NORM) * scale
        k = _load_qk(k_ptr, rows, row_ok, stride_kt, (h // GROUP) * stride_kh, kc, k_ok, USE_L2NORM)
        if not DOT_IN_FP32:  # every use rounds them to DT: hold them so, in half the registers
            q, k = q.to(DT), k.to(DT)
        g = tl.load(g_ptr + rows * stride_gt + h * stride_gh, mask=row_ok, other=0.0)
        cum = tl.cumsum(g, 0)
        cum_last = tl.sum(g, 0)
        buf_rows = rows[:, None] * NUM_V_HEADS + h
        w = tl.load(w_ptr + buf_rows * K_DIM + kc[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        u = tl.load(u_ptr + buf_rows * V_DIM + vc[None, :], mask=row_ok[:, None] & v_ok[None, :], other=0.0)
        v_new = u.to(tl.float32) - _dot(w, s, DT, DOT_PRECISION, DOT_IN_FP32)  # [BT, BV]
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
        attn = _dot(q, tl.trans(k), DT, DOT_PRECISION, DOT_IN_FP32) * decay
        o = _dot(q.to(tl.float32) * tl.exp(cum)[:, None], s, DT, DOT_PRECISION, DOT_IN_FP32)
        o += _dot(attn, v_new, DT, DOT_PRECISION, DOT_IN_FP32)
        tl.store(o_ptr + rows[:, None] * stride_ot + h * stride_oh + vc[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & v_ok[None, :])
        k_tail = k.to(tl.float32) * tl.exp(cum_last - cum)[:, None]
        s = s * tl.exp(cum_last) + _dot(tl.trans(k_tail), v_new, DT, DOT_PRECISION, DOT_IN_FP32)
    if slot >= 0:
        tl.store(state_ptr + s_offs, s, mask=s_mask)


@triton.jit
def _gdn_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, idx_ptr, cu_ptr, has_init_ptr, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh, stride_bt, stride_bh,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, NUM_V_HEADS: tl.constexpr, K_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_L2NORM: tl.constexpr,
):
    seq, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos, slot, from_slot = _seq_meta(cu_ptr, idx_ptr, has_init_ptr, seq)
    if bos >= eos:
        return
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
    if slot >= 0:
        tl.store(state_ptr + s_offs, s, mask=s_mask)


_INTERPRETED = not isinstance(_gdn_chunk_scan_kernel, triton.runtime.jit.JITFunction)
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


# Both chunk kernels run as one warpgroup (4 warps). Their dots have CHUNK_SIZE = 64 rows, one
# wgmma's M, and the scan chains them with a 128-row dot (the state update). At 8 warps Triton's
# sm_90 compile (3.6 and 3.9 alike) gives the scan's 64-row dots the state update's [8, 1] warp
# layout: a second warpgroup over rows 64..127 of 64-row tiles. That was the launch under which the
# H200 gave wrong head-dim-128 outputs and then an illegal memory access, while the same kernels at
# 4 warps (the small-shape GPU tests) matched the reference. test_gdn_triton.py's sm_90 compile
# test checks that every dot's warp layout fits inside its tile.
CHUNK_NUM_WARPS = 4


def chunk_constexprs(num_k_heads: int, num_v_heads: int, k_dim: int, v_dim: int, dtype: torch.dtype,
                     use_qk_l2norm: bool) -> dict:
    """The constexprs both chunk kernels share (the sm_90 compile test builds its launches from them)."""
    return dict(GROUP=num_v_heads // num_k_heads, NUM_V_HEADS=num_v_heads, K_DIM=k_dim, V_DIM=v_dim,
                BT=CHUNK_SIZE, BK=max(16, next_pow2(k_dim)), USE_L2NORM=use_qk_l2norm, **_dot_kwargs(dtype))


def prep_block_v(v_dim: int) -> int:
    return max(16, next_pow2(v_dim))  # the whole head: U = T (beta v) is one dot


def scan_block_v(v_dim: int) -> int:
    """The state scan's v block: narrow, and no software pipelining of its chunk loop (num_stages=1),
    as the chunk's q, k, W tiles and the state block already fill the registers."""
    return min(32, max(16, next_pow2(v_dim)))


def chunk_bounds(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[max_chunks, 2] int32 (start, end) token rows of every chunk in the batch, on the device and
    without a host sync; max_chunks = T // CHUNK_SIZE + N bounds sum(ceil(len_i / CHUNK_SIZE)), and
    the unused tail holds empty (0, 0) chunks."""
    num_seqs = cu_seqlens.shape[0] - 1
    max_chunks = num_tokens // CHUNK_SIZE + num_seqs
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    chunk_ends = torch.cumsum((lens + CHUNK_SIZE - 1) // CHUNK_SIZE, 0)  # [N] chunks up to each sequence's end
    ids = torch.arange(max_chunks, device=cu.device)
    seq = torch.searchsorted(chunk_ends, ids, right=True).clamp_max(num_seqs - 1)
    first = chunk_ends[seq] - (lens[seq] + CHUNK_SIZE - 1) // CHUNK_SIZE
    start = cu[seq] + (ids - first) * CHUNK_SIZE
    valid = ids < chunk_ends[-1]
    end = torch.minimum(start + CHUNK_SIZE, cu[seq + 1])
    return torch.stack([torch.where(valid, start, 0), torch.where(valid, end, 0)], 1).to(torch.int32).contiguous()


# The widest head the chunked kernels pass their GPU test at: at Qwen3-Next's 128 they fault on the
# H200 (TestChunkGatedDeltaRule::test_chunked_kernel_at_qwen3_next_shapes, an expected failure until
# fixed), so wider heads run the recurrent kernel, which has the same contract and passes there.
CHUNK_MAX_HEAD_DIM = 64


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor, cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor,
    *, scale: float, use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """Prefill; see kernels.gdn_ref.chunk_gated_delta_rule. Returns o [T, Hv, Dv] in v's dtype. Heads
    up to CHUNK_MAX_HEAD_DIM wide run the chunked kernels, wider ones the recurrent kernel."""
    rule = chunked_gated_delta_rule
    if max(q.shape[-1], v.shape[-1]) > CHUNK_MAX_HEAD_DIM:
        rule = fused_recurrent_gated_delta_rule
    return rule(q, k, v, g, beta, state, state_indices, cu_seqlens, has_initial_state, scale=scale,
                use_qk_l2norm=use_qk_l2norm)


def chunked_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor, cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor,
    *, scale: float, use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """The chunked (WY / UT) prefill kernels: per chunk the prep kernel, then the state scan."""
    _check(q, k, v, g, beta, state, state_indices, cu_seqlens, has_initial_state)
    num_tokens, num_k_heads, k_dim = q.shape
    num_v_heads, v_dim = v.shape[1:]
    out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    num_seqs = state_indices.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    bounds = chunk_bounds(cu_seqlens, num_tokens)
    w = torch.empty((num_tokens, num_v_heads, k_dim), dtype=q.dtype, device=q.device)
    u = torch.empty((num_tokens, num_v_heads, v_dim), dtype=q.dtype, device=q.device)
    shapes = chunk_constexprs(num_k_heads, num_v_heads, k_dim, v_dim, q.dtype, use_qk_l2norm)
    _gdn_chunk_prep_kernel[(bounds.shape[0], num_v_heads)](
        k, v, g, beta, w, u, bounds, bounds.shape[0], k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), BV=prep_block_v(v_dim), **shapes,
        num_warps=CHUNK_NUM_WARPS,
    )
    block_v = scan_block_v(v_dim)
    _gdn_chunk_scan_kernel[(num_seqs, num_v_heads, triton.cdiv(v_dim, block_v))](
        q, k, w, u, g, out, state, state_indices, cu_seqlens, has_initial_state, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), g.stride(0), g.stride(1), out.stride(0), out.stride(1),
        BV=block_v, **shapes, num_warps=CHUNK_NUM_WARPS, num_stages=1,
    )
    return out


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor, cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor,
    *, scale: float, use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """Token-by-token step for 1..few tokens a sequence (decode, drafts); see
    kernels.gdn_ref.fused_recurrent_gated_delta_rule. Grid from shapes only: CUDA-graph safe."""
    _check(q, k, v, g, beta, state, state_indices, cu_seqlens, has_initial_state)
    num_k_heads, k_dim = q.shape[1:]
    num_v_heads, v_dim = v.shape[1:]
    out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    num_seqs = state_indices.shape[0]
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    block_v = min(32, max(16, next_pow2(v_dim)))
    _gdn_recurrent_kernel[(num_seqs, num_v_heads, triton.cdiv(v_dim, block_v))](
        q, k, v, g, beta, out, state, state_indices, cu_seqlens, has_initial_state, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1),
        beta.stride(0), beta.stride(1), out.stride(0), out.stride(1),
        GROUP=num_v_heads // num_k_heads, NUM_V_HEADS=num_v_heads, K_DIM=k_dim, V_DIM=v_dim,
        BK=next_pow2(k_dim), BV=block_v, USE_L2NORM=use_qk_l2norm, num_warps=4,
    )
    return out
