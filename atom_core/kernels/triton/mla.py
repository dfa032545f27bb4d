"""Multi-head latent attention (Triton) over the paged latent cache; the torch reference with
the same signature is `kernels/mla_ref.py` (read its docstring for the math and the layout).

Work split
  A program owns BLOCK_M rows: BLOCK_Q consecutive query tokens of one sequence times BLOCK_H
  heads (row r = token r // BLOCK_H, head r % BLOCK_H). All heads read the same latent row,
  so each latent tile is loaded once per (sequence, query tile, head block) and serves
  BLOCK_M rows through two tensor-core dots (scores: q_latent . c + q_rope . r; output p @ c).
  Decode uses BLOCK_Q = 1; prefill chunks and multi-token (speculative) rows use BLOCK_Q > 1
  with a per-row causal mask, so one launch serves any flat batch with no host sync.
  Grid = (num_seqs * num_q_blocks, num_head_blocks, num_splits).

Split-KV (flash-decoding)
  With few programs and long contexts each program's KV range is cut into num_splits runs of
  tiles, computed on the device from seq_lens (so a CUDA graph captured with a stale
  max_seq_len stays right); partial (out, lse) go to fp32 scratch and a second kernel merges
  them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_core.kernels.triton.attention import softmax_tile, split_lse
from atom_core.kernels.triton.common import (
    check_dim, check_float, check_int, check_last_dim_contiguous, check_same_device, next_pow2, sm_count,
)

LOG2E = 1.4426950408889634
SPLIT_TARGET_PROGRAMS_PER_SM = 2
MAX_KV_SPLITS = 32
MAX_SPLIT_SCRATCH_BYTES = 256 << 20


@triton.jit
def latent_tile_step(ql, qr, rows, n_ok, visible, offs_c, offs_r, scale_log2e, m_i, l_i, acc,
                     LATENT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One tile of absorbed MLA with an online softmax: the latent rows at `rows` [N] (pointers;
    n_ok masks the loads) score q_latent . c + q_rope . r for the M query rows, `visible` [M, N]
    masks the scores, and (m_i, l_i, acc) advance over the tile's latents. Returns the new triple."""
    c = tl.load(rows[:, None] + offs_c[None, :], mask=n_ok[:, None], other=0.0)  # [N, C]
    r = tl.load(rows[:, None] + LATENT + offs_r[None, :], mask=n_ok[:, None], other=0.0)  # [N, R]
    if UPCAST:
        c = c.to(tl.float32)
        r = r.to(tl.float32)
    s = tl.dot(ql, tl.trans(c), input_precision=DOT_PRECISION)
    s = tl.dot(qr, tl.trans(r), s, input_precision=DOT_PRECISION) * scale_log2e  # [M, N], log2 units
    s = tl.where(visible, s, float("-inf"))
    p, alpha, l_i, m_new = softmax_tile(s, m_i, l_i)
    acc = tl.dot(p.to(c.dtype), c, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["num_tokens", "num_q_blocks", "num_splits", "stride_bt"])
def _mla_kernel(
    ql_ptr, qr_ptr, kv_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    scale_log2e, num_tokens, num_q_blocks, num_splits,
    stride_qlt, stride_qlh, stride_qrt, stride_qrh, stride_kvb, stride_kvs,
    stride_ot, stride_oh, stride_bt,
    NUM_HEADS: tl.constexpr, LATENT: tl.constexpr, ROPE: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_SPLIT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    seq = pid // num_q_blocks
    q_block = num_q_blocks - 1 - pid % num_q_blocks  # longest (causal) query tile first
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_c = tl.arange(0, LATENT)
    offs_r = tl.arange(0, ROPE)
    q_idx = q_block * BLOCK_Q + offs_m // BLOCK_H
    head = head_block * BLOCK_H + offs_m % BLOCK_H
    row_ok = (q_idx < q_len) & (head < NUM_HEADS) & (offs_m < BLOCK_Q * BLOCK_H)
    q_pos = ctx_len + q_idx
    token = (q_start + q_idx).to(tl.int64)
    ql = tl.load(ql_ptr + token[:, None] * stride_qlt + head[:, None] * stride_qlh + offs_c[None, :],
                 mask=row_ok[:, None], other=0.0)
    qr = tl.load(qr_ptr + token[:, None] * stride_qrt + head[:, None] * stride_qrh + offs_r[None, :],
                 mask=row_ok[:, None], other=0.0)
    if UPCAST:
        ql = ql.to(tl.float32)
        qr = qr.to(tl.float32)

    kv_end = tl.minimum(seq_len, ctx_len + tl.minimum(q_len, (q_block + 1) * BLOCK_Q))
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, LATENT], dtype=tl.float32)
    for tile in range(tile_lo, tile_hi):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_end
        block_ids = tl.load(block_table_row + offs_n // KV_BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        rows = kv_ptr + block_ids * stride_kvb + (offs_n % KV_BLOCK_SIZE) * stride_kvs
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        m_i, l_i, acc = latent_tile_step(ql, qr, rows, n_ok, visible, offs_c, offs_r, scale_log2e, m_i, l_i, acc,
                                         LATENT, UPCAST, DOT_PRECISION)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    if IS_SPLIT:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        row = (split * num_tokens + token) * NUM_HEADS + head  # [splits, T, H] row-major
        tl.store(part_out_ptr + row[:, None] * LATENT + offs_c[None, :], o, mask=row_ok[:, None])
        tl.store(part_lse_ptr + row, lse, mask=row_ok)
    else:
        o_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_c[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "num_splits"])
def _mla_merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, query_start_loc_ptr,
    num_seqs, num_tokens, num_splits, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, LATENT: tl.constexpr, SPLITS_P: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    if token >= tl.load(query_start_loc_ptr + num_seqs):  # graph padding rows own no partials
        return
    offs_s = tl.arange(0, SPLITS_P)
    offs_c = tl.arange(0, LATENT)
    row, s_ok, lse, lse_max = split_lse(part_lse_ptr, offs_s, token, head, num_tokens, num_splits, NUM_HEADS)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.math.exp2(lse - lse_max)
    parts = tl.load(part_out_ptr + row[:, None] * LATENT + offs_c[None, :], mask=s_ok[:, None], other=0.0)
    w_sum = tl.sum(w, 0)
    o = tl.sum(parts * w[:, None], 0) / tl.where(w_sum == 0.0, 1.0, w_sum)
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + offs_c, o.to(out_ptr.dtype.element_ty))


_INTERPRETED = not isinstance(_mla_kernel, triton.runtime.jit.JITFunction)


class MLALaunch:
    """Tile shape for one (decode or not, heads) class; overridable for sweeps and tests."""

    def __init__(self, max_query_len: int, num_heads: int, block_n: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None):
        decode = max_query_len == 1
        self.block_h = min(next_pow2(num_heads), 16 if decode else 64)
        self.block_q = 1 if decode else max(1, min(next_pow2(max_query_len), 64 // self.block_h))
        self.block_m = max(16, self.block_q * self.block_h)  # tl.dot needs M >= 16
        self.block_n = block_n or (32 if decode else 32)
        self.num_warps = num_warps or (4 if self.block_m <= 16 else 8)
        self.num_stages = num_stages or 2


def _check_args(q_latent, q_rope, kv_cache, block_tables, query_start_loc, seq_lens, out):
    for name, t, n in (("q_latent", q_latent, 3), ("q_rope", q_rope, 3), ("kv_cache", kv_cache, 4),
                       ("block_tables", block_tables, 2)):
        check_dim(name, t, n)
        check_last_dim_contiguous(name, t)
    for name, t in (("q_latent", q_latent), ("q_rope", q_rope), ("kv_cache", kv_cache)):
        check_float(name, t)
    for name, t in (("block_tables", block_tables), ("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        check_int(name, t)
    num_tokens, num_heads, latent = q_latent.shape
    rope = q_rope.shape[2]
    if q_rope.shape[:2] != (num_tokens, num_heads):
        raise ValueError(f"q_rope {tuple(q_rope.shape)} must be [T={num_tokens}, H={num_heads}, R]")
    if kv_cache.shape[2] != 1 or kv_cache.shape[3] != latent + rope or kv_cache.stride(2) != latent + rope:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} must be [NB, BS, 1, {latent} + {rope}], rows contiguous")
    if latent != next_pow2(latent) or rope != next_pow2(rope) or min(latent, rope) < 16:
        raise ValueError(f"the Triton MLA kernel needs power-of-two latent and rope dims >= 16, "
                         f"got {latent} and {rope}")
    if q_latent.dtype != kv_cache.dtype or q_rope.dtype != kv_cache.dtype:
        raise ValueError(f"queries {q_latent.dtype}/{q_rope.dtype} must have the cache dtype {kv_cache.dtype}")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.shape[0] < num_seqs:
        raise ValueError(f"need query_start_loc [S+1] and block_tables [>=S, MB] for S={num_seqs}")
    if out is not None and (out.shape != q_latent.shape or out.dtype != q_latent.dtype or out.stride(-1) != 1):
        raise ValueError(f"out must be {tuple(q_latent.shape)} {q_latent.dtype} with a contiguous last dim")
    check_same_device(q_latent=q_latent, q_rope=q_rope, kv_cache=kv_cache, block_tables=block_tables,
                      query_start_loc=query_start_loc, seq_lens=seq_lens)


def choose_num_kv_splits(num_programs: int, max_seq_len: int, device: torch.device, scratch_per_split: int,
                         block_n: int) -> int:
    """Split only while the unsplit grid is under one program per SM; then aim for ~2 per SM."""
    sms = sm_count(device)
    if num_programs >= sms:
        return 1
    target = SPLIT_TARGET_PROGRAMS_PER_SM * sms
    splits = min(triton.cdiv(target, num_programs), triton.cdiv(max_seq_len, block_n), MAX_KV_SPLITS)
    # A power of two (rounded down): an odd split count leaves the splits' KV runs misaligned with
    # the tiles, and measured markedly slower than the power of two below it (see docs/PERFORMANCE.md).
    splits = 1 << (max(1, splits).bit_length() - 1)
    while splits > 1 and splits * scratch_per_split > MAX_SPLIT_SCRATCH_BYTES:
        splits //= 2
    return max(1, splits)


def launch_mla_attention(
    q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_query_len: int, max_seq_len: int,
    out: torch.Tensor | None = None, *, num_kv_splits: int | None = None, block_n: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None,
) -> torch.Tensor:
    """`mla_attention` with overrides of the split count and the tile shape (tests, sweeps)."""
    _check_args(q_latent, q_rope, kv_cache, block_tables, query_start_loc, seq_lens, out)
    if out is None:
        out = torch.empty_like(q_latent)
    num_tokens, num_heads, latent = q_latent.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0 or max_query_len <= 0:
        return out
    cfg = MLALaunch(max_query_len, num_heads, block_n, num_warps, num_stages)
    num_q_blocks = triton.cdiv(max_query_len, cfg.block_q)
    num_head_blocks = triton.cdiv(num_heads, cfg.block_h)
    programs = num_seqs * num_q_blocks * num_head_blocks
    splits = num_kv_splits or choose_num_kv_splits(programs, max_seq_len, q_latent.device,
                                                   num_tokens * num_heads * (latent + 1) * 4, cfg.block_n)
    if splits > 1:
        part_out = torch.empty(splits, num_tokens, num_heads, latent, dtype=torch.float32, device=q_latent.device)
        part_lse = torch.empty(splits, num_tokens, num_heads, dtype=torch.float32, device=q_latent.device)
    else:
        part_out = part_lse = out  # unused
    _mla_kernel[(num_seqs * num_q_blocks, num_head_blocks, splits)](
        q_latent, q_rope, kv_cache, out, part_out, part_lse, block_tables, query_start_loc, seq_lens,
        scale * LOG2E, num_tokens, num_q_blocks, splits,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        NUM_HEADS=num_heads, LATENT=latent, ROPE=q_rope.shape[2], KV_BLOCK_SIZE=kv_cache.shape[1],
        BLOCK_H=cfg.block_h, BLOCK_Q=cfg.block_q, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        IS_SPLIT=splits > 1, UPCAST=_INTERPRETED and q_latent.dtype != torch.float32,
        DOT_PRECISION="ieee" if q_latent.dtype == torch.float32 else None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        _mla_merge_kernel[(num_tokens, num_heads)](
            part_out, part_lse, out, query_start_loc, num_seqs, num_tokens, splits, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, LATENT=latent, SPLITS_P=next_pow2(splits), num_warps=4,
        )
    return out


def mla_attention(
    q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_query_len: int, max_seq_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as kernels.mla_ref.mla_attention."""
    return launch_mla_attention(q_latent, q_rope, kv_cache, block_tables, query_start_loc, seq_lens, scale,
                                max_query_len, max_seq_len, out)
