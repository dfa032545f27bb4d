"""DeepSeek Sparse Attention's indexer (Triton): scores over the paged indexer key cache and the
per-row top-k; the torch references with the same signatures are in `kernels/dsa_ref.py` (read
its docstring for the math and the selection order).

Work split
  Scores: one program per (query row, BLOCK_N keys); the row's Hi heads are the M side of one
  tensor-core dot [Hi, D] x [D, N], relu'd and summed with the head weights. Programs whose
  keys lie past the row's position write -inf and stop, so a CUDA graph captured with
  max_model_len as the width stays right for any context.
  Top-k: one program per query row. The k-th largest score is found by a 32-step binary search
  on the scores' order-preserving int32 keys (each step counts the keys >= the midpoint over
  the row's visible positions only), then one pass writes the positions above it and the first
  ties, ascending, as cache slots through the block table. Both grids come from max_query_len
  and the host width, never from device values: no host sync.
  FP8 keys (an index_scale_cache): per scale group, the e4m3 codes are converted to the query's
  dtype (exact) for one tensor-core dot, whose columns are then scaled by their keys' group scale.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_core.kernels.triton.common import (
    check_dim, check_float, check_int, check_last_dim_contiguous, check_same_device, next_pow2,
)


@triton.jit
def _query_row(pid, max_query_len, query_start_loc_ptr, seq_lens_ptr):
    """Program pid's query row under a (sequences x max_query_len) grid: (sequence, whether the
    row exists, its flat token index (int64), its position)."""
    seq = pid // max_query_len
    qi = pid % max_query_len
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    pos = tl.load(seq_lens_ptr + seq) - q_len + qi
    return seq, qi < q_len, (q_start + qi).to(tl.int64), pos


@triton.jit(do_not_specialize=["max_query_len", "width", "stride_bt"])
def _index_scores_kernel(
    q_ptr, w_ptr, k_ptr, ks_ptr, out_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    scale, max_query_len, width,
    stride_qt, stride_qh, stride_wt, stride_kb, stride_ks, stride_sb, stride_ss, stride_ot, stride_bt,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    FP8_GROUP: tl.constexpr,
):
    tile = tl.program_id(1)
    seq, exists, token, pos = _query_row(tl.program_id(0), max_query_len, query_start_loc_ptr, seq_lens_ptr)
    if not exists:
        return
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    out_row = out_ptr + token * stride_ot
    if tile * BLOCK_N > pos:
        tl.store(out_row + offs_n, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=offs_n < width)
        return
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < NUM_HEADS
    w = tl.load(w_ptr + token * stride_wt + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    n_ok = offs_n <= pos
    block_ids = tl.load(block_tables_ptr + seq.to(tl.int64) * stride_bt + offs_n // KV_BLOCK_SIZE, mask=n_ok,
                        other=0).to(tl.int64)
    key_rows = block_ids * stride_kb + (offs_n % KV_BLOCK_SIZE) * stride_ks
    q_row = q_ptr + token * stride_qt + offs_h[:, None] * stride_qh
    if FP8_GROUP > 0:
        # One dot a scale group: the e4m3 codes become the query's dtype exactly (3 mantissa bits),
        # the tensor cores take them as they take bf16 keys, and each key's group scale multiplies
        # its column of the group's dot afterwards.
        scale_rows = block_ids * stride_sb + (offs_n % KV_BLOCK_SIZE) * stride_ss
        s = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
        for g in tl.static_range(HEAD_DIM // FP8_GROUP):
            offs_g = g * FP8_GROUP + tl.arange(0, FP8_GROUP)
            q = tl.load(q_row + offs_g[None, :], mask=h_ok[:, None], other=0.0)
            k = tl.load(k_ptr + key_rows[:, None] + offs_g[None, :], mask=n_ok[:, None], other=0.0).to(q.dtype)
            if UPCAST:
                q = q.to(tl.float32)
                k = k.to(tl.float32)
            group_scale = tl.load(ks_ptr + scale_rows + g, mask=n_ok, other=0.0)
            s += tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * group_scale[None, :]
        s = s * scale
    else:
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_row + offs_d[None, :], mask=h_ok[:, None], other=0.0)
        k = tl.load(k_ptr + key_rows[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [H, N]
    score = tl.sum(tl.maximum(s, 0.0) * w[:, None], 0)
    tl.store(out_row + offs_n, tl.where(n_ok, score, float("-inf")), mask=offs_n < width)


@triton.jit
def _ordered_key(x):
    """float32 -> int32 with the same order (negative floats flip their magnitude bits); -0.0
    becomes +0.0 first, as the two compare equal (relu makes exact zeros common)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit(do_not_specialize=["max_query_len", "stride_st", "stride_ot", "stride_bt"])
def _topk_kernel(
    scores_ptr, out_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    max_query_len, stride_st, stride_ot, stride_bt,
    K: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr,
):
    seq, exists, token, pos = _query_row(tl.program_id(0), max_query_len, query_start_loc_ptr, seq_lens_ptr)
    if not exists:
        return
    visible = pos + 1  # positions 0 .. pos: the only finite scores
    row = scores_ptr + token * stride_st
    offs = tl.arange(0, BLOCK)
    # The largest tau with count(key >= tau) >= K (tau stays at INT32_MIN when fewer are visible).
    lo = tl.full([], -2147483648, tl.int64)
    hi = tl.full([], 2147483647, tl.int64)
    if visible > K:
        for _ in tl.static_range(32):
            mid = (lo + hi + 1) // 2
            count = tl.zeros([], tl.int32)
            for start in range(0, visible, BLOCK):
                idx = start + offs
                key = _ordered_key(tl.load(row + idx, mask=idx < visible, other=float("-inf"))).to(tl.int64)
                count += tl.sum(((key >= mid) & (idx < visible)).to(tl.int32), 0)
            lo = tl.where(count >= K, mid, lo)
            hi = tl.where(count >= K, hi, mid - 1)
    num_above = tl.zeros([], tl.int32)
    for start in range(0, visible, BLOCK):
        idx = start + offs
        key = _ordered_key(tl.load(row + idx, mask=idx < visible, other=float("-inf"))).to(tl.int64)
        num_above += tl.sum(((key > lo) & (idx < visible)).to(tl.int32), 0)
    ties_wanted = K - num_above
    ties_seen = tl.zeros([], tl.int32)
    written = tl.zeros([], tl.int32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(0, visible, BLOCK):
        idx = start + offs
        ok = idx < visible
        key = _ordered_key(tl.load(row + idx, mask=ok, other=float("-inf"))).to(tl.int64)
        tie = ((key == lo) & ok).to(tl.int32)
        tie_rank = ties_seen + tl.cumsum(tie, 0) - tie
        chosen = ((key > lo) & ok) | ((tie == 1) & (tie_rank < ties_wanted))
        pick = chosen.to(tl.int32)
        dest = written + tl.cumsum(pick, 0) - pick
        block = tl.load(table + idx // KV_BLOCK_SIZE, mask=chosen, other=0)
        tl.store(out_ptr + token * stride_ot + dest, block * KV_BLOCK_SIZE + idx % KV_BLOCK_SIZE, mask=chosen)
        ties_seen += tl.sum(tie, 0)
        written += tl.sum(pick, 0)


_INTERPRETED = not isinstance(_index_scores_kernel, triton.runtime.jit.JITFunction)


def _check_metadata(block_tables, query_start_loc, seq_lens):
    check_dim("block_tables", block_tables, 2)
    for name, t in (("block_tables", block_tables), ("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        check_int(name, t)
    if query_start_loc.shape != (seq_lens.shape[0] + 1,) or block_tables.shape[0] < seq_lens.shape[0]:
        raise ValueError(f"need query_start_loc [S+1] and block_tables [>=S, MB] for S={seq_lens.shape[0]}")


def dsa_index_scores(
    index_q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_seq_len: int,
    max_query_len: int | None = None, index_scale_cache: torch.Tensor | None = None, *, block_n: int = 64,
) -> torch.Tensor:
    """Same contract as kernels.dsa_ref.dsa_index_scores (max_query_len: an upper bound of the
    rows per sequence, the grid's; default: every row could be one sequence's)."""
    check_dim("index_q", index_q, 3)
    check_dim("weights", weights, 2)
    check_dim("index_cache", index_cache, 4)
    for name, t in (("index_q", index_q), ("weights", weights), ("index_cache", index_cache)):
        if t is not index_cache or t.dtype != torch.float8_e4m3fn:  # FP8 keys: _check_fp8_keys
            check_float(name, t)
        check_last_dim_contiguous(name, t)
    _check_metadata(block_tables, query_start_loc, seq_lens)
    num_tokens, num_heads, head_dim = index_q.shape
    fp8_group = _check_fp8_keys(index_cache, index_scale_cache, head_dim)
    if (fp8_group == 0 and index_cache.shape[2:] != (1, head_dim)) or weights.shape != (num_tokens, num_heads):
        raise ValueError(f"index_cache {tuple(index_cache.shape)} must be [NB, BS, 1, {head_dim}] and weights "
                         f"{tuple(weights.shape)} [{num_tokens}, {num_heads}]")
    if head_dim != next_pow2(head_dim) or head_dim < 16 or (fp8_group == 0 and index_q.dtype != index_cache.dtype):
        raise ValueError(f"the Triton indexer needs a power-of-two head dim >= 16 and queries in the cache dtype, "
                         f"got {head_dim}, {index_q.dtype} / {index_cache.dtype}")
    check_same_device(index_q=index_q, weights=weights, index_cache=index_cache, block_tables=block_tables,
                      query_start_loc=query_start_loc, seq_lens=seq_lens)
    out = torch.empty(num_tokens, max_seq_len, dtype=torch.float32, device=index_q.device)
    num_seqs = seq_lens.shape[0]
    max_query_len = num_tokens if max_query_len is None else max_query_len
    if num_tokens == 0 or num_seqs == 0 or max_seq_len == 0:
        return out
    scales = index_scale_cache if index_scale_cache is not None else out  # out: an unread stand-in pointer
    _index_scores_kernel[(num_seqs * max_query_len, triton.cdiv(max_seq_len, block_n))](
        index_q, weights, index_cache, scales, out, block_tables, query_start_loc, seq_lens, scale, max_query_len,
        max_seq_len, index_q.stride(0), index_q.stride(1), weights.stride(0), index_cache.stride(0),
        index_cache.stride(1), scales.stride(0), scales.stride(1), out.stride(0), block_tables.stride(0),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, KV_BLOCK_SIZE=index_cache.shape[1],
        BLOCK_H=max(16, next_pow2(num_heads)), BLOCK_N=block_n,
        DOT_PRECISION="ieee" if index_q.dtype == torch.float32 else None,
        UPCAST=_INTERPRETED and index_q.dtype != torch.float32, FP8_GROUP=fp8_group, num_warps=4,
    )
    return out


def _check_fp8_keys(index_cache: torch.Tensor, index_scale_cache: torch.Tensor | None, head_dim: int) -> int:
    """The FP8 keys' group size (0: keys in the query dtype, no scales)."""
    if index_scale_cache is None:
        if index_cache.dtype == torch.float8_e4m3fn:
            raise ValueError("FP8 indexer keys need their index_scale_cache")
        return 0
    groups = index_cache.shape[2]
    if (index_cache.dtype != torch.float8_e4m3fn or index_scale_cache.dtype != torch.float32
            or index_cache.shape[2:] != (groups, head_dim // groups) or groups * index_cache.shape[3] != head_dim
            or index_scale_cache.shape != index_cache.shape[:3] or index_scale_cache.stride(2) != 1
            or index_cache.stride(2) != index_cache.shape[3]):
        raise ValueError(f"FP8 indexer keys: index_cache float8_e4m3fn [NB, BS, G, {head_dim} / G] (contiguous "
                         f"groups) and index_scale_cache float32 [NB, BS, G], got {index_cache.dtype} "
                         f"{tuple(index_cache.shape)} and {index_scale_cache.dtype} {tuple(index_scale_cache.shape)}")
    check_same_device(index_cache=index_cache, index_scale_cache=index_scale_cache)
    group = head_dim // groups
    if group < 16 or group != next_pow2(group):
        raise ValueError(f"FP8 indexer keys: a scale group of {group} values; the Triton indexer needs a power of "
                         "two >= 16 (one tensor-core dot a group)")
    return group


def dsa_topk(
    scores: torch.Tensor, index_topk: int, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor, block_size: int, max_query_len: int | None = None, *, block: int = 1024,
) -> torch.Tensor:
    """Same contract as kernels.dsa_ref.dsa_topk (max_query_len as for dsa_index_scores)."""
    check_dim("scores", scores, 2)
    if scores.dtype != torch.float32 or scores.stride(1) != 1:
        raise ValueError(f"scores must be float32 with a contiguous last dim, got {scores.dtype}")
    _check_metadata(block_tables, query_start_loc, seq_lens)
    check_same_device(scores=scores, block_tables=block_tables, query_start_loc=query_start_loc, seq_lens=seq_lens)
    num_tokens = scores.shape[0]
    out = torch.full((num_tokens, index_topk), -1, dtype=torch.int32, device=scores.device)
    num_seqs = seq_lens.shape[0]
    max_query_len = num_tokens if max_query_len is None else max_query_len
    if num_tokens == 0 or num_seqs == 0:
        return out
    _topk_kernel[(num_seqs * max_query_len,)](
        scores, out, block_tables, query_start_loc, seq_lens, max_query_len, scores.stride(0), out.stride(0),
        block_tables.stride(0), K=index_topk, KV_BLOCK_SIZE=block_size, BLOCK=block, num_warps=8,
    )
    return out
