"""Paged attention (Triton): one launch for a flat batch of prefill chunks and decode rows.

Work split
  A program owns BLOCK_M "rows": BLOCK_Q consecutive query tokens of one sequence times the
  GROUP query heads that share one KV head (row r = token r // GROUP_P, head r % GROUP_P).
  So each K/V tile is read once per (sequence, kv head, query tile) and serves every head of
  the group; for decode (BLOCK_Q = 1) that is once per (sequence, kv head).
  Grid = (num_seqs * cdiv(max_query_len, BLOCK_Q), num_kv_heads, num_splits); decode folds the
  kv heads into the first axis so one sequence's heads start together. Programs whose
  query tile lies past their sequence's q_len return at once: this is how a program finds its
  rows without any host sync (max_query_len only sizes the grid).

Inner loop
  Flash-attention online softmax (base-2, fp32 running max / sum / accumulator) over BLOCK_N
  KV positions at a time; each position's physical block comes from the block table, so
  BLOCK_N is independent of the cache block size. Tiles that lie entirely before the tile's
  first query position need no causal or length mask and take an unmasked path.

Split-KV (flash-decoding)
  When (seqs x q tiles x kv heads) is too few programs to fill the GPU and contexts are long,
  each program's KV range is cut into num_splits equal runs of tiles; partial (out, lse) go
  to fp32 scratch and a second kernel merges them. The ranges are computed on the device
  from seq_lens, so the result is right for any seq_lens even when the host's max_seq_len
  (used only for the heuristic) is stale, e.g. captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_core.kernels.torch_ref import FP8_KV_DTYPES
from atom_core.kernels.triton.common import (
    LaunchPlans, PlannedLaunch, check_dim, check_float, check_int, check_last_dim_contiguous, check_same_device,
    next_pow2, sm_count,
)
from atom_core.kernels.triton.kv_store import check_token_scales

LOG2E = 1.4426950408889634
# Split-KV tuning (bf16, Llama-3-8B heads, CUDA-graph timing; see docs/PERFORMANCE.md): splitting
# only pays while the unsplit grid is under one program per SM (batch 32 x 8 kv heads = 256
# programs ran fastest unsplit); then aim for ~2 programs per SM, each split >= one KV tile.
SPLIT_TARGET_PROGRAMS_PER_SM = 2
MAX_KV_SPLITS = 32
# Scratch for split partials is fp32 [splits, T, H, D]; beyond this, use fewer splits.
MAX_SPLIT_SCRATCH_BYTES = 256 << 20

@triton.jit
def softmax_tile(s, m_i, l_i):
    """The online-softmax step of one tile of scores s [M, N] (log2 units): (p, the factor alpha
    the running sums rescale by, the new l_i, the new running max)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row may see no position in a masked tile (e.g. a later split); keep exp2 finite.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def _attend_tile(
    acc, l_i, m_i, q, q_pos, tile, kv_end,
    block_table_row, k_base, v_base, stride_kb, stride_ks, stride_vb, stride_vs, scale_log2e,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, window=0, HAS_WINDOW: tl.constexpr = False, KV_FP8: tl.constexpr = False,
    ks_base=None, vs_base=None, stride_sb=0, stride_ss=0, TOKEN_SCALES: tl.constexpr = False,
):
    """One online-softmax step over KV positions [tile * BLOCK_N, (tile + 1) * BLOCK_N).
    KV_FP8: the tiles are converted to the query's type here (per-layer scales are folded into
    scale_log2e and the output by the caller). TOKEN_SCALES: each position's own K scale
    multiplies its score column before the softmax, its V scale its probability column (the
    same sum as scaling V's row, without rounding scaled V to the dot's input type)."""
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    n_ok = offs_n < kv_end
    if MASKED:
        block_ids = tl.load(block_table_row + offs_n // KV_BLOCK_SIZE, mask=n_ok, other=0)
        k_mask = n_ok[None, :] & d_ok[:, None]
        v_mask = n_ok[:, None] & d_ok[None, :]
    else:
        block_ids = tl.load(block_table_row + offs_n // KV_BLOCK_SIZE)
        k_mask = d_ok[:, None]
        v_mask = d_ok[None, :]
    # int64: block id * block stride overflows int32 for caches beyond 2^31 elements.
    block_ids = block_ids.to(tl.int64)
    in_block = offs_n % KV_BLOCK_SIZE
    k_ptrs = k_base + block_ids[None, :] * stride_kb + in_block[None, :] * stride_ks + offs_d[:, None]
    v_ptrs = v_base + block_ids[:, None] * stride_vb + in_block[:, None] * stride_vs + offs_d[None, :]
    if HEAD_DIM == BLOCK_D and not MASKED:
        k = tl.load(k_ptrs)  # [BLOCK_D, BLOCK_N]
        v = tl.load(v_ptrs)  # [BLOCK_N, BLOCK_D]
    else:
        k = tl.load(k_ptrs, mask=k_mask, other=0.0)
        v = tl.load(v_ptrs, mask=v_mask, other=0.0)
    if DOT_IN_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    elif KV_FP8:
        k = k.to(q.dtype)
        v = v.to(q.dtype)

    s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2e  # [BLOCK_M, BLOCK_N], log2 units
    if TOKEN_SCALES:  # [NB, BS, KH] scales at (block, slot); 0 where masked (that score is hidden anyway)
        s_offs = block_ids * stride_sb + in_block * stride_ss
        if MASKED:
            k_s = tl.load(ks_base + s_offs, mask=n_ok, other=0.0)
            v_s = tl.load(vs_base + s_offs, mask=n_ok, other=0.0)
        else:
            k_s = tl.load(ks_base + s_offs)
            v_s = tl.load(vs_base + s_offs)
        s = s * k_s[None, :]
    if MASKED:
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        if HAS_WINDOW:  # sliding window: a row at position p sees (p - window, p]
            visible &= offs_n[None, :] > q_pos[:, None] - window
        s = tl.where(visible, s, float("-inf"))
    p, alpha, l_i, m_new = softmax_tile(s, m_i, l_i)
    acc = acc * alpha[:, None]
    if TOKEN_SCALES:
        p = p * v_s[None, :]  # after l_i: the denominator sums the unscaled probabilities
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


# Per-step sizes are plain runtime ints: specialising on them (== 1, % 16) would JIT-compile
# new variants in the middle of a run (the block-table width too: a width of 16 did).
@triton.jit
def load_query_rows(q_ptr, q_start, q_idx, head, row_ok, offs_d, stride_qt, stride_qh, HEAD_DIM: tl.constexpr,
                    DOT_IN_FP32: tl.constexpr):
    """A query tile's rows [BLOCK_M, BLOCK_D] (row r: query row q_idx[r] of the sequence whose rows
    start at q_start, head head[r]), their token (int64) and the row and dim mask the output store
    reuses; upcast to float32 under DOT_IN_FP32 (the interpreter's bf16 dot, see _INTERPRETED)."""
    token = (q_start + q_idx).to(tl.int64)
    io_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=io_mask, other=0.0)
    if DOT_IN_FP32:
        q = q.to(tl.float32)
    return token, io_mask, q


@triton.jit
def split_lse(part_lse_ptr, offs_s, token, head, num_tokens, num_splits, NUM_HEADS: tl.constexpr):
    """A split-KV merge's view of one (token, head): the rows of its partials in the [splits, T, H]
    buffers (offs_s: the caller's arange over the padded split count), which rows are real splits,
    their log2-sum-exps (-inf where padded or empty) and the largest of them."""
    s_ok = offs_s < num_splits
    row = (offs_s.to(tl.int64) * num_tokens + token) * NUM_HEADS + head
    lse = tl.load(part_lse_ptr + row, mask=s_ok, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    return row, s_ok, lse, lse_max


@triton.jit(do_not_specialize=["num_tokens", "num_q_blocks", "num_splits", "stride_bt", "window"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, seq_order_ptr,
    scale_log2e, num_tokens, num_q_blocks, num_splits,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_bt,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    HAS_ORDER: tl.constexpr, HEADS_INNER: tl.constexpr, window=0, HAS_WINDOW: tl.constexpr = False,
    sinks_ptr=None, HAS_SINKS: tl.constexpr = False, v_scale=1.0, KV_FP8: tl.constexpr = False,
    k_scales_ptr=None, v_scales_ptr=None, stride_sb=0, stride_ss=0, stride_sh=0, TOKEN_SCALES: tl.constexpr = False,
):
    if HEADS_INNER:  # the kv heads of one sequence are neighbours in launch order
        pid = tl.program_id(0) // (NUM_HEADS // GROUP)
        kv_head = tl.program_id(0) % (NUM_HEADS // GROUP)
    else:
        pid = tl.program_id(0)
        kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Programs start roughly in pid order; with seq_order (longest first) the last wave holds
    # the shortest sequences, so SMs finish together instead of waiting on a long tail.
    if HAS_ORDER:
        seq = tl.load(seq_order_ptr + pid // num_q_blocks)
    else:
        seq = pid // num_q_blocks
    # Highest query tile first: under the causal mask it has the most KV to read, so starting
    # the long programs early shortens the tail of a prefill launch.
    q_block = num_q_blocks - 1 - pid % num_q_blocks

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # tokens cached before this step's query rows

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_idx = q_block * BLOCK_Q + offs_m // GROUP_P  # query row within the sequence
    head = kv_head * GROUP + offs_m % GROUP_P
    row_ok = (q_idx < q_len) & (offs_m % GROUP_P < GROUP)
    q_pos = ctx_len + q_idx  # the row's absolute position: it sees KV positions <= q_pos
    token, io_mask, q = load_query_rows(q_ptr, q_start, q_idx, head, row_ok, offs_d, stride_qt, stride_qh, HEAD_DIM,
                                        DOT_IN_FP32)

    # KV range of this program: up to the last row's position, cut into equal runs of tiles.
    first_pos = ctx_len + q_block * BLOCK_Q
    kv_end = tl.minimum(seq_len, ctx_len + tl.minimum(q_len, (q_block + 1) * BLOCK_Q))
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    first_tile = 0
    if HAS_WINDOW:  # tiles wholly before the first row's window are read by no row
        first_tile = tl.maximum(first_pos - window + 1, 0) // BLOCK_N
    tiles_per_split = tl.cdiv(num_tiles - first_tile, num_splits)
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    # Tiles ending at or before first_pos + 1 are visible to every row: no mask needed
    # (with a window every tile is masked: its lower edge moves with the row).
    tile_mid = tl.maximum(tl.minimum(tile_hi, (first_pos + 1) // BLOCK_N), tile_lo)
    if HAS_WINDOW:
        tile_mid = tile_lo

    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    ks_base = k_scales_ptr + kv_head * stride_sh  # per-token-head scales (TOKEN_SCALES only)
    vs_base = v_scales_ptr + kv_head * stride_sh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for tile in range(tile_lo, tile_mid):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pos, tile, kv_end, block_table_row, k_base, v_base,
            stride_kb, stride_ks, stride_vb, stride_vs, scale_log2e,
            HEAD_DIM, BLOCK_D, KV_BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION, DOT_IN_FP32, KV_FP8=KV_FP8,
            ks_base=ks_base, vs_base=vs_base, stride_sb=stride_sb, stride_ss=stride_ss, TOKEN_SCALES=TOKEN_SCALES)
    for tile in range(tile_mid, tile_hi):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pos, tile, kv_end, block_table_row, k_base, v_base,
            stride_kb, stride_ks, stride_vb, stride_vs, scale_log2e,
            HEAD_DIM, BLOCK_D, KV_BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION, DOT_IN_FP32, window, HAS_WINDOW, KV_FP8,
            ks_base, vs_base, stride_sb, stride_ss, TOKEN_SCALES)

    # l_i == 0 only for an empty range (seq_len 0 padding rows, empty splits): output 0.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    if HAS_SINKS and not IS_SPLIT:  # the sink joins the denominator (split: in the merge)
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        l_safe = l_i + tl.math.exp2(sink - tl.where(m_i == float("-inf"), 0.0, m_i))
    o = acc / l_safe[:, None]
    if KV_FP8 and not TOKEN_SCALES:  # V was read as V / v_scale
        o = o * v_scale
    if IS_SPLIT:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        row = (split * num_tokens + token) * NUM_HEADS + head  # [splits, T, H] row-major
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=io_mask)
        tl.store(part_lse_ptr + row, lse, mask=row_ok)
    else:
        o_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "num_splits", "max_query_len"])
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, query_start_loc_ptr, seq_order_ptr,
    num_seqs, num_tokens, num_splits, max_query_len, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_P: tl.constexpr,
    HAS_ORDER: tl.constexpr, sinks_ptr=None, HAS_SINKS: tl.constexpr = False,
):
    head = tl.program_id(1)
    # Only rows that have partials are merged, as the unsplit path writes only those: with
    # seq_order the listed sequences' rows (program = listed seq x query row; the others may be
    # another launch's), else every row up to the last sequence's (not CUDA-graph padding).
    if HAS_ORDER:
        seq = tl.load(seq_order_ptr + tl.program_id(0) // max_query_len)
        token = tl.load(query_start_loc_ptr + seq) + tl.program_id(0) % max_query_len
        end = tl.load(query_start_loc_ptr + seq + 1)
    else:
        token = tl.program_id(0)
        end = tl.load(query_start_loc_ptr + num_seqs)
    if token >= end:
        return
    offs_s = tl.arange(0, SPLITS_P)
    offs_d = tl.arange(0, BLOCK_D)
    row, s_ok, lse, lse_max = split_lse(part_lse_ptr, offs_s, token, head, num_tokens, num_splits, NUM_HEADS)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634  # log2 units, like lse
        lse_max = tl.maximum(lse_max, sink)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.math.exp2(lse - lse_max)  # 0 for empty splits
    parts = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=s_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    w_sum = tl.sum(w, 0)
    if HAS_SINKS:  # a per-head logit in the denominator, no value
        w_sum += tl.math.exp2(sink - lse_max)
    o = tl.sum(parts * w[:, None], 0) / tl.where(w_sum == 0.0, 1.0, w_sum)
    o_ptrs = out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + offs_d
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


# Triton's CPU interpreter (TRITON_INTERPRET=1) multiplies bf16 dot operands as raw uint16
# (triton 3.9 interpreter.create_dot); there, and only there, the kernel upcasts them first.
_INTERPRETED = not isinstance(_paged_attention_kernel, triton.runtime.jit.JITFunction)


class _TileConfig:
    """Launch shape for one (max_query_len, group, head_dim) class; see module docstring."""

    def __init__(self, max_query_len: int, group_p: int, head_dim: int):
        # Chosen by sweeping BLOCK_N x warps x stages on bench_kernels' shapes (see docs/PERFORMANCE.md).
        self.block_d = max(16, next_pow2(head_dim))
        if max_query_len == 1:  # decode: one token x the whole head group per program
            self.block_q = 1
            # Long tiles keep HBM busy; D=256 stays at 32 to bound shared memory (3 stages).
            self.block_n = 128 if self.block_d <= 128 else 32
            self.num_stages = 3
        else:
            rows = 128 if self.block_d <= 64 else 64
            self.block_q = max(1, min(next_pow2(max_query_len), rows // group_p))
            self.block_n = 64 if self.block_d <= 128 else 32
            self.num_stages = 2
        self.block_m = max(16, self.block_q * group_p)  # tl.dot needs M >= 16
        self.num_warps = 8 if self.block_m * self.block_d >= 128 * 128 else 4


def choose_num_kv_splits(num_programs: int, max_seq_len: int, device: torch.device,
                         scratch_bytes_per_split: int, block_n: int = 128) -> int:
    """How many KV splits to use (1 = no split); see SPLIT_TARGET_PROGRAMS_PER_SM."""
    sms = sm_count(device)
    if num_programs >= sms:
        return 1
    target = SPLIT_TARGET_PROGRAMS_PER_SM * sms
    splits = min(triton.cdiv(target, num_programs), triton.cdiv(max_seq_len, block_n), MAX_KV_SPLITS)
    while splits > 1 and splits * scratch_bytes_per_split > MAX_SPLIT_SCRATCH_BYTES:
        splits //= 2
    return max(1, splits)


def _check_attention_args(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out):
    check_dim("query", query, 3)
    check_dim("k_cache", k_cache, 4)
    check_float("query", query)
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache "
                         f"{tuple(v_cache.shape)} {v_cache.dtype} must match")
    if k_cache.dtype != query.dtype and k_cache.dtype not in FP8_KV_DTYPES:
        raise ValueError(f"kv cache dtype {k_cache.dtype} must equal query dtype {query.dtype} or be an FP8 type")
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"query [T, {num_heads}, {head_dim}] does not fit kv cache "
                         f"{tuple(k_cache.shape)}: need equal head_dim and num_heads % kv_heads == 0")
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("block_tables", block_tables)):
        check_last_dim_contiguous(name, t)
    check_dim("block_tables", block_tables, 2)
    for name, t in (("block_tables", block_tables), ("query_start_loc", query_start_loc),
                    ("seq_lens", seq_lens)):
        check_int(name, t)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.shape[0] < num_seqs:
        raise ValueError(f"need query_start_loc [S+1] and block_tables [>=S, MB] for S={num_seqs}, got "
                         f"{tuple(query_start_loc.shape)} and {tuple(block_tables.shape)}")
    if out is not None:
        if out.shape != query.shape or out.dtype != query.dtype:
            raise ValueError(f"out must be {tuple(query.shape)} {query.dtype}, got {tuple(out.shape)} {out.dtype}")
        check_last_dim_contiguous("out", out)
    check_same_device(query=query, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                      query_start_loc=query_start_loc, seq_lens=seq_lens)


_PLANS = LaunchPlans()  # by inputs (see _paged_plan): the layers of one step share one
_MAX_PLANS = LaunchPlans.MAX_SIZE


class _PagedPlan:
    """What a paged attention launch decides on the host from its inputs' layouts and host ints:
    the grid, the split count and the kernel's arguments besides the per-layer tensors (launch_args:
    positional layout values, keyword constexprs). Validation ran when it was made."""

    def __init__(self, keep, num_tokens, num_heads, head_dim, num_listed, num_seqs, num_kv_splits, grid,
                 launch_args, merge):
        self.keep = keep  # the metadata tensors whose ids are in the key
        self.num_tokens, self.num_heads, self.head_dim = num_tokens, num_heads, head_dim
        self.num_listed, self.num_seqs = num_listed, num_seqs
        self.num_kv_splits, self.grid = num_kv_splits, grid
        self.launch_args, self.merge = launch_args, merge
        # The layers' launches: only their query, caches, output (and scratch) differ.
        self.kernel = PlannedLaunch(_paged_attention_kernel, grid, _PAGED_PER_CALL) if grid is not None else None
        self.merge_kernel = (PlannedLaunch(_merge_splits_kernel, (merge[0], num_heads), _MERGE_PER_CALL)
                             if merge else None)


_PAGED_PER_CALL = ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "part_out_ptr", "part_lse_ptr", "k_scales_ptr",
                   "v_scales_ptr")
_MERGE_PER_CALL = ("part_out_ptr", "part_lse_ptr", "out_ptr")


def _paged_plan(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, scale, max_query_len,
                max_seq_len, num_kv_splits, seq_order, heads_inner, sliding_window, sinks, k_scale, v_scale):
    """The launch plan of these inputs, made (and the inputs validated) on the first call with their
    layouts: a step's layers pass the same metadata tensors and same-shaped caches, so 31 of 32
    skip the checks and choices (host time a piecewise step's 64 attention launches spend)."""
    key = (id(block_tables), id(query_start_loc), id(seq_lens), id(seq_order), id(sinks),
           query.shape, query.stride(), query.dtype, query.device, k_cache.shape, k_cache.stride(), k_cache.dtype,
           k_cache.device, v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device,
           None if out is None else (out.shape, out.stride(), out.dtype),
           scale, max_query_len, max_seq_len, num_kv_splits, heads_inner, sliding_window,
           k_scale if not isinstance(k_scale, torch.Tensor) else id(k_scale),
           v_scale if not isinstance(v_scale, torch.Tensor) else id(v_scale))
    return _PLANS.get_or_make(key, lambda: _make_paged_plan(
        query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, scale, max_query_len, max_seq_len,
        num_kv_splits, seq_order, heads_inner, sliding_window, sinks, k_scale, v_scale))


def _make_paged_plan(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, scale, max_query_len,
                     max_seq_len, num_kv_splits, seq_order, heads_inner, sliding_window, sinks, k_scale, v_scale):
    _check_attention_args(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out)
    token_scales = check_token_scales(k_cache, k_scale, v_scale)
    if sinks is not None:
        if sinks.shape != (query.shape[1],):
            raise ValueError(f"sinks must be [H={query.shape[1]}] (one logit per query head), got {tuple(sinks.shape)}")
        check_float("sinks", sinks)
        check_last_dim_contiguous("sinks", sinks)
        check_same_device(query=query, sinks=sinks)
    keep = (block_tables, query_start_loc, seq_lens, seq_order, sinks, k_scale, v_scale)
    num_tokens, num_heads, head_dim = query.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], k_cache.shape[2]
    num_listed = seq_order.shape[0] if seq_order is not None else num_seqs  # seq_order may list a subset
    if num_tokens == 0 or num_listed == 0 or max_query_len <= 0:  # nothing to launch
        return _PagedPlan(keep, num_tokens, num_heads, head_dim, 0, num_seqs, 0, None, None, None)
    group = num_heads // num_kv_heads
    kv_fp8 = k_cache.dtype in FP8_KV_DTYPES
    cfg = _TileConfig(max_query_len, next_pow2(group), head_dim)
    num_q_blocks = triton.cdiv(max_query_len, cfg.block_q)
    num_programs = num_listed * num_q_blocks * num_kv_heads
    split_bytes = num_tokens * num_heads * (head_dim + 1) * 4
    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(num_programs, max_seq_len, query.device, split_bytes, cfg.block_n)
    is_split = num_kv_splits > 1
    if heads_inner is None:
        # Decode: a sequence's kv heads run as neighbours, since they read interleaved slices
        # of the same cache rows ([block, slot, kv head, D]), so the rows stay in L2 between
        # them; with seq_order (longest first) this measured faster at mid-size batches and never
        # slower (see docs/PERFORMANCE.md). Prefill keeps the 2-D grid.
        heads_inner = max_query_len == 1
    if heads_inner:
        grid = (num_listed * num_q_blocks * num_kv_heads, 1, num_kv_splits)
    else:
        grid = (num_listed * num_q_blocks, num_kv_heads, num_kv_splits)
    kernel_kwargs = dict(
        NUM_HEADS=num_heads, GROUP=group, GROUP_P=next_pow2(group),
        HEAD_DIM=head_dim, BLOCK_D=cfg.block_d, KV_BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=cfg.block_m, BLOCK_Q=cfg.block_q, BLOCK_N=cfg.block_n,
        IS_SPLIT=is_split, DOT_PRECISION="ieee" if query.dtype == torch.float32 else None,
        DOT_IN_FP32=_INTERPRETED and query.dtype == torch.bfloat16, HAS_ORDER=seq_order is not None,
        HEADS_INNER=heads_inner, window=sliding_window or 0, HAS_WINDOW=sliding_window is not None,
        sinks_ptr=sinks, HAS_SINKS=sinks is not None, v_scale=v_scale if kv_fp8 and not token_scales else 1.0,
        KV_FP8=kv_fp8, stride_sb=k_scale.stride(0) if token_scales else 0, stride_ss=k_scale.stride(1) if token_scales else 0,
        stride_sh=k_scale.stride(2) if token_scales else 0, TOKEN_SCALES=token_scales,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    layout = (scale * LOG2E * (k_scale if kv_fp8 and not token_scales else 1.0), num_tokens, num_q_blocks,
              num_kv_splits, query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
              v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
    merge = None
    if is_split:
        # A seq_order listing every sequence (a decode batch's launch order) merges every row as
        # before; only a subset (a mixed step's launches) merges by listed sequence.
        subset = seq_order is not None and num_listed < num_seqs
        merge = (num_listed * max_query_len if subset else num_tokens, subset, dict(
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=cfg.block_d, SPLITS_P=max(2, next_pow2(num_kv_splits)),
            HAS_ORDER=subset, sinks_ptr=sinks, HAS_SINKS=sinks is not None, num_warps=4), max_query_len)
    return _PagedPlan(keep, num_tokens, num_heads, head_dim, num_listed, num_seqs, num_kv_splits, grid,
                      (layout, kernel_kwargs), merge)


def launch_paged_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_query_len: int,
    max_seq_len: int, out: torch.Tensor | None = None, *, num_kv_splits: int | None = None,
    seq_order: torch.Tensor | None = None, heads_inner: bool | None = None, sliding_window: int | None = None,
    sinks: torch.Tensor | None = None, k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0,
    direct_launch: bool = True,
) -> torch.Tensor:
    """`paged_attention` with overrides of the split count and launch order (tests, benchmarks)."""
    plan = _paged_plan(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, scale, max_query_len,
                       max_seq_len, num_kv_splits, seq_order, heads_inner, sliding_window, sinks, k_scale, v_scale)
    if out is None:
        out = torch.empty_like(query)
    if plan.grid is None:
        return out
    num_tokens, num_heads, head_dim = plan.num_tokens, plan.num_heads, plan.head_dim
    if plan.merge is not None:
        part_out = torch.empty((plan.num_kv_splits, num_tokens, num_heads, head_dim),
                               dtype=torch.float32, device=query.device)
        part_lse = torch.empty((plan.num_kv_splits, num_tokens, num_heads), dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # unused by the kernel when IS_SPLIT is False
    layout, kernel_kwargs = plan.launch_args
    token_scales = kernel_kwargs["TOKEN_SCALES"]
    k_scales, v_scales = (k_scale, v_scale) if token_scales else (k_cache, v_cache)  # the caches: unused stand-ins
    plan.kernel(
        (query, k_cache, v_cache, out, part_out, part_lse, k_scales, v_scales),
        lambda: ((query, k_cache, v_cache, out, part_out, part_lse,
                  block_tables, query_start_loc, seq_lens, seq_order if seq_order is not None else seq_lens,
                  *layout, out.stride(0), out.stride(1), block_tables.stride(0)),
                 dict(k_scales_ptr=k_scales, v_scales_ptr=v_scales, **kernel_kwargs)),
        direct_launch,
    )
    if plan.merge is not None:
        merge_rows, subset, merge_kwargs, max_q = plan.merge
        plan.merge_kernel(
            (part_out, part_lse, out),
            lambda: ((part_out, part_lse, out, query_start_loc, seq_order if subset else query_start_loc,
                      plan.num_seqs, num_tokens, plan.num_kv_splits, max_q, out.stride(0), out.stride(1)),
                     merge_kwargs),
            direct_launch,
        )
    return out


def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [NB, BS, KH, D]
    v_cache: torch.Tensor,  # [NB, BS, KH, D]
    block_tables: torch.Tensor,  # [S, MB] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32
    seq_lens: torch.Tensor,  # [S] int32
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    out: torch.Tensor | None = None,  # [T, H, D]
    seq_order: torch.Tensor | None = None,  # [S'] int32: the sequences to attend, in launch order (S' <= S)
    sliding_window: int | None = None,  # a row at position p sees KV positions (p - window, p]
    sinks: torch.Tensor | None = None,  # [H] float: a per-head logit in the softmax denominator, no value
    k_scale: float | torch.Tensor = 1.0,  # FP8 caches: stored K times k_scale is K,
    v_scale: float | torch.Tensor = 1.0,  # or [NB, BS, KH] float32 per-token-head scales
    direct_launch: bool = True,  # False: through Triton's JIT call path every time (PlannedLaunch)
) -> torch.Tensor:
    """Causal paged attention; same contract as `torch_ref.paged_attention`.

    Host work reads only shapes and the two host ints, so it is CUDA-graph safe.
    max_query_len must bound every q_len (it sizes the grid; longer rows would be skipped);
    max_seq_len only steers the split-KV heuristic. Rows of `out` owned by no sequence
    (T beyond query_start_loc[S]) are left untouched, as in the reference. A seq_order that
    lists a subset attends only those sequences and writes only their rows, split or not (the
    others' rows are left untouched, so several launches can fill one `out`).
    """
    return launch_paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                  scale, max_query_len, max_seq_len, out, seq_order=seq_order,
                                  sliding_window=sliding_window, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
                                  direct_launch=direct_launch)


def warm_up_variants(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, dtype: torch.dtype,
                     max_query_len: int, threads: int = 1, sliding_window: int | None = None,
                     sinks: torch.Tensor | None = None, k_scale: float | torch.Tensor = 1.0,
                     v_scale: float | torch.Tensor = 1.0, ordered_prefill: bool = False) -> int:
    """JIT-compile every kernel variant a run can need (decode and each prefill tile height,
    split and unsplit) on tiny inputs, so no step pays a compile; returns how many launched.
    A layer with a sliding window, sinks or per-token-head KV scales compiles its own
    (HAS_WINDOW / HAS_SINKS / TOKEN_SCALES) variants: pass its window, sinks and scales.
    ordered_prefill: prefill tiles launched with a seq_order too (the split-by-context prefill path).

    The variants depend only on constexprs (tile shape per max_query_len class, IS_SPLIT); the
    inputs read block 0 of the real cache and write a scratch output. threads > 1 compiles
    variants concurrently (ptxas and much of the compiler run outside the GIL).
    """
    head_dim, num_kv_heads = k_cache.shape[-1], k_cache.shape[2]
    device = k_cache.device
    group_p = next_pow2(num_heads // num_kv_heads)
    lengths, q = [1], 2
    while q <= max_query_len:
        lengths.append(q)
        if _TileConfig(q, group_p, head_dim).block_q < next_pow2(q):
            break  # taller queries share this tile height
        q *= 2

    def launch(variant: tuple[int, int, bool]) -> None:
        q_len, splits, subset = variant
        num_seqs = 2 if subset else 1  # subset: the order lists one of two (a mixed step's launches)
        query = torch.zeros(q_len * num_seqs, num_heads, head_dim, dtype=dtype, device=device)
        qsl = torch.arange(num_seqs + 1, dtype=torch.int32, device=device) * q_len
        seq_len = q_len + 512  # cached context too, so both splits get tiles
        lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device)
        tables = torch.zeros(num_seqs, triton.cdiv(seq_len, k_cache.shape[1]), dtype=torch.int32, device=device)
        order = qsl[:1] if q_len == 1 or ordered_prefill else None  # decode batches carry a sequence order
        launch_paged_attention(query, k_cache, v_cache, tables, qsl, lens, 1.0, q_len, seq_len, num_kv_splits=splits,
                               seq_order=order, sliding_window=sliding_window, sinks=sinks,
                               k_scale=k_scale, v_scale=v_scale)

    # The merge of a subset launch is its own variant (HAS_ORDER): decode and, with ordered_prefill,
    # the prefill tiles.
    variants = [(q_len, splits, False) for q_len in lengths for splits in (1, 2)]
    variants += [(q_len, 2, True) for q_len in lengths if q_len == 1 or ordered_prefill]
    if threads > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(launch, variants))
    else:
        for variant in variants:
            launch(variant)
    return len(variants)
