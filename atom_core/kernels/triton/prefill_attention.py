"""Prefill attention over the step's own contiguous K/V rows (Triton, varlen, FA2-style).

For a sequence with no cached context (a prompt's first chunk) every key it attends to was
produced in this step, so K and V can be read from the step's rows ([T, KH, D], row = token)
instead of gathered back from the paged cache through the block table. The paged kernel
(attention.py) keeps everything else: chunks with cached context, decode rows, FP8 caches.

Work split (as the paged kernel's GROUP_P): a program owns BLOCK_M rows = BLOCK_Q consecutive
query tokens x GROUP_P query heads of one KV head (row r = token r // GROUP_P, head r % GROUP_P),
so every K/V tile is loaded once for all heads of the group. One grid axis of q tiles x
sequences x kv heads, highest q tile first (under the causal mask it reads the most keys); a
program past its sequence's length returns at once.

Inner loop: online softmax in base 2 (log2(e) folded into the scale), fp32 running max, sum
and accumulator. Causal structure per program (query tokens [q0, q0 + BLOCK_Q)):
  tiles ending at or before q0 + 1  -> every row sees every key: no mask at all;
  tiles overlapping [q0, q_last]    -> the diagonal: causal mask;
  tiles starting after q_last       -> never visited.
With a sliding window the lower edge moves with the row, so every visited tile is masked (as in
the paged kernel) and tiles wholly before the first row's window are skipped. Sinks add a
per-head logit to the denominator in the epilogue.

Values: a cache in the model dtype holds exactly the K/V rows this kernel reads (the store is a
plain cast of the same rounded values), so results equal the paged path's up to summation
order. FP8 caches hold codes (K / k_scale rounded to e4m3) and the reference attends over those,
so FP8-KV layers stay on the paged kernel (the backend routes them there).

Tiles (untuned; fast enough with them to be the CUDA default, see docs/PERFORMANCE.md):
`PrefillTileConfig` picks BLOCK_M 128 x BLOCK_N 64 (head_dim <= 128) from the Hopper FA2 Triton
practice; `TILE_CANDIDATES` lists the BLOCK_M 64/128 x BLOCK_N 64/128 x warps x stages grid the
GPU benchmark sweeps.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from atom_core.kernels.triton.attention import load_query_rows
from atom_core.kernels.triton.common import (
    LaunchPlans, PlannedLaunch, check_dim, check_float, check_int, check_last_dim_contiguous, check_same_device,
    next_pow2,
)
from atom_core.kernels.triton.qkv_prep import norm_rope, store_heads
from atom_core.kernels.triton.rotary import token_cos_sin

LOG2E = 1.4426950408889634

# ---------------------------------------------------------------------------------------------
# K rows: the same norm + RoPE arithmetic as qkv_rope_store's cache store, to contiguous rows


@triton.jit
def _rope_k_rows_kernel(
    qkv_ptr, positions_ptr, cos_sin_ptr, k_norm_ptr, k_out_ptr, eps, stride_t, stride_cs, stride_ot,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr, REST: tl.constexpr, HAS_NORM: tl.constexpr,
    BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
):
    token, cos, sin = token_cos_sin(positions_ptr, cos_sin_ptr, stride_cs, HALF, BLOCK_HALF)
    k_src = qkv_ptr + token * stride_t + NUM_HEADS * HEAD_DIM
    o1, o2, rest = norm_rope(k_src, HEAD_DIM, k_norm_ptr, eps, cos, sin, NUM_KV_HEADS, HEAD_DIM, HALF, REST,
                              BLOCK_KH, BLOCK_HALF, BLOCK_REST, HAS_NORM)
    store_heads(k_out_ptr + token * stride_ot, HEAD_DIM, o1, o2, rest, NUM_KV_HEADS, HALF, REST,
                 BLOCK_KH, BLOCK_HALF, BLOCK_REST)


def rope_k_rows(
    qkv: torch.Tensor,  # [T, (H + 2 * KH) * D]
    positions: torch.Tensor,  # [T] int
    cos_sin_cache: torch.Tensor,  # [max_pos, rot_dim] float32
    num_heads: int,
    num_kv_heads: int,
    k_norm_weight: torch.Tensor | None = None,  # [D] (Qwen3's per-head k norm)
    eps: float = 1e-6,
    direct_launch: bool = True,  # False: through Triton's JIT call path every time (PlannedLaunch)
) -> torch.Tensor:
    """K [T, KH, D] after the optional per-head RMSNorm and neox RoPE: bit for bit what
    qkv_rope_store writes to a cache in the model dtype (same helpers, same roundings).
    One extra launch that reads and writes T x KH x D; folding a `k_out` into qkv_rope_store
    would save it. Checks and launch choices are made once per input layout (the step's layers
    share them: `_rope_plan`)."""
    key = (qkv.shape, qkv.stride(), qkv.dtype, qkv.device, positions.shape, positions.dtype, positions.device,
           cos_sin_cache.shape, cos_sin_cache.stride(), cos_sin_cache.dtype, cos_sin_cache.device, num_heads,
           num_kv_heads, None if k_norm_weight is None else k_norm_weight.shape, eps)
    num_tokens, head_dim, kwargs, kernel = _ROPE_PLANS.get_or_make(key, lambda: _rope_plan(
        qkv, positions, cos_sin_cache, num_heads, num_kv_heads, k_norm_weight))
    k = torch.empty(num_tokens, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return k
    norm = k_norm_weight if k_norm_weight is not None else k
    kernel((qkv, positions, cos_sin_cache, norm, k),
           lambda: ((qkv, positions, cos_sin_cache, norm, k, eps, qkv.stride(0), cos_sin_cache.stride(0),
                     k.stride(0)), kwargs), direct_launch)
    return k


_ROPE_PLANS = LaunchPlans()  # rope_k_rows', by its inputs' layouts
_ROPE_PER_CALL = ("qkv_ptr", "positions_ptr", "cos_sin_ptr", "k_norm_ptr", "k_out_ptr")


def _rope_plan(qkv, positions, cos_sin_cache, num_heads, num_kv_heads, k_norm_weight) -> tuple:
    check_dim("qkv", qkv, 2)
    check_float("qkv", qkv)
    check_last_dim_contiguous("qkv", qkv)
    check_int("positions", positions)
    num_tokens = qkv.shape[0]
    head_dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or positions.shape != (num_tokens,):
        raise ValueError(f"qkv {tuple(qkv.shape)} / positions {tuple(positions.shape)} do not hold "
                         f"{num_heads} q heads plus 2 x {num_kv_heads} kv heads per token")
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.stride(-1) != 1:
        raise ValueError(f"cos_sin_cache must be float32 with a contiguous last dim, got {cos_sin_cache.dtype}")
    rot_dim = cos_sin_cache.shape[1]
    if rot_dim % 2 or rot_dim > head_dim:
        raise ValueError(f"rot_dim {rot_dim} must be even and <= head_dim {head_dim}")
    if k_norm_weight is not None and k_norm_weight.shape != (head_dim,):
        raise ValueError(f"k norm weight must be [{head_dim}], got {tuple(k_norm_weight.shape)}")
    check_same_device(qkv=qkv, positions=positions, cos_sin_cache=cos_sin_cache)
    half, rest = rot_dim // 2, head_dim - rot_dim
    kwargs = dict(NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=half, REST=rest,
                  HAS_NORM=k_norm_weight is not None, BLOCK_KH=next_pow2(num_kv_heads), BLOCK_HALF=next_pow2(half),
                  BLOCK_REST=max(1, next_pow2(rest)), num_warps=4)
    return num_tokens, head_dim, kwargs, PlannedLaunch(_rope_k_rows_kernel, (num_tokens,), _ROPE_PER_CALL)


# ---------------------------------------------------------------------------------------------
# attention


@triton.jit
def _prefill_tile(
    acc, l_i, m_i, q, q_idx, tile, kv_end, k_base, v_base, stride_kt, stride_vt, scale_log2e,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr, window=0, HAS_WINDOW: tl.constexpr = False,
):
    """One online-softmax step over keys [tile * BLOCK_N, (tile + 1) * BLOCK_N) of the sequence."""
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rows = offs_n.to(tl.int64)
    k_ptrs = k_base + rows[None, :] * stride_kt + offs_d[:, None]  # [BLOCK_D, BLOCK_N]
    v_ptrs = v_base + rows[:, None] * stride_vt + offs_d[None, :]  # [BLOCK_N, BLOCK_D]
    if MASKED:
        n_ok = offs_n < kv_end
        k = tl.load(k_ptrs, mask=n_ok[None, :] & (offs_d[:, None] < HEAD_DIM), other=0.0)
        v = tl.load(v_ptrs, mask=n_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    elif HEAD_DIM == BLOCK_D:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        k = tl.load(k_ptrs, mask=offs_d[:, None] < HEAD_DIM, other=0.0)
        v = tl.load(v_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    if DOT_IN_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2e  # [BLOCK_M, BLOCK_N], log2 units
    if MASKED:
        visible = (offs_n[None, :] <= q_idx[:, None]) & n_ok[None, :]
        if HAS_WINDOW:  # a row at position p sees (p - window, p]
            visible &= offs_n[None, :] > q_idx[:, None] - window
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row may see nothing in a masked tile
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_i, m_new


# Per-step sizes are runtime ints: specialising on them would compile new variants mid-run.
@triton.jit(do_not_specialize=["num_seqs", "num_q_blocks", "window"])
def _prefill_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cu_seqlens_ptr, seq_ids_ptr, scale_log2e, num_seqs, num_q_blocks,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    window=0, HAS_WINDOW: tl.constexpr = False, sinks_ptr=None, HAS_SINKS: tl.constexpr = False,
):
    # Launch order: highest query tile first over all sequences and heads (under the causal mask it
    # reads the most keys), so the last wave holds short programs and SMs finish together.
    pid = tl.program_id(0)
    kv_head = pid % NUM_KV_HEADS
    rest = pid // NUM_KV_HEADS
    seq = tl.load(seq_ids_ptr + rest % num_seqs)
    q_block = num_q_blocks - 1 - rest // num_seqs
    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    first_pos = q_block * BLOCK_Q
    if first_pos >= q_len:
        return

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_idx = first_pos + offs_m // GROUP_P  # the row's position: no cached context, so position = index
    head = kv_head * GROUP + offs_m % GROUP_P
    row_ok = (q_idx < q_len) & (offs_m % GROUP_P < GROUP)
    token, io_mask, q = load_query_rows(q_ptr, q_start, q_idx, head, row_ok, offs_d, stride_qt, stride_qh, HEAD_DIM,
                                        DOT_IN_FP32)

    kv_end = tl.minimum(q_len, first_pos + BLOCK_Q)  # one past the last row's position
    tile_hi = tl.cdiv(kv_end, BLOCK_N)
    tile_mid = tl.minimum((first_pos + 1) // BLOCK_N, tile_hi)  # tiles below it: seen whole by every row
    tile_lo = 0
    if HAS_WINDOW:
        tile_lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N
        tile_mid = tile_lo
    k_base = k_ptr + q_start.to(tl.int64) * stride_kt + kv_head * stride_kh
    v_base = v_ptr + q_start.to(tl.int64) * stride_vt + kv_head * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for tile in range(tile_lo, tile_mid):
        acc, l_i, m_i = _prefill_tile(acc, l_i, m_i, q, q_idx, tile, kv_end, k_base, v_base, stride_kt, stride_vt,
                                      scale_log2e, HEAD_DIM, BLOCK_D, BLOCK_N, False, DOT_PRECISION, DOT_IN_FP32)
    for tile in range(tile_mid, tile_hi):
        acc, l_i, m_i = _prefill_tile(acc, l_i, m_i, q, q_idx, tile, kv_end, k_base, v_base, stride_kt, stride_vt,
                                      scale_log2e, HEAD_DIM, BLOCK_D, BLOCK_N, True, DOT_PRECISION, DOT_IN_FP32,
                                      window, HAS_WINDOW)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # every valid row sees itself; padding lanes stay 0
    if HAS_SINKS:  # a per-head logit in the denominator, no value
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        l_safe = l_i + tl.math.exp2(sink - tl.where(m_i == float("-inf"), 0.0, m_i))
    o = acc / l_safe[:, None]
    o_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=io_mask)


# The interpreter multiplies bf16 dot operands as raw integers (see attention.py); upcast there only.
_INTERPRETED = not isinstance(_prefill_attention_kernel, triton.runtime.jit.JITFunction)


@dataclass(frozen=True)
class PrefillTileConfig:
    """One launch shape. block_m counts rows (tokens x padded GQA group); block_q = block_m // group_p."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# The sweep's grid (sm_90): BLOCK_M 64/128 x BLOCK_N 64/128, 4/8 warps, 2/3 stages.
TILE_CANDIDATES: tuple[PrefillTileConfig, ...] = tuple(
    PrefillTileConfig(m, n, w, s) for m in (64, 128) for n in (64, 128) for w in (4, 8) for s in (2, 3))


def default_tile_config(head_dim: int) -> PrefillTileConfig:
    """Untuned defaults (TILE_CANDIDATES is the grid to sweep). D <= 64: wide key tiles, 4 warps; D 128: the FA2-Triton
    Hopper shape 128 x 64 on 8 warps, 3 stages (two K/V tiles in flight: 64 KiB of shared memory
    in bf16); D 256: 64 x 32 to bound registers and shared memory."""
    block_d = max(16, next_pow2(head_dim))
    if block_d <= 64:
        return PrefillTileConfig(128, 64, 4, 3)
    if block_d <= 128:
        return PrefillTileConfig(128, 64, 8, 3)
    return PrefillTileConfig(64, 32, 4, 2)


def _check_args(query, key, value, cu_seqlens, seq_ids, out, sinks):
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_dim(name, t, 3)
        check_float(name, t)
        check_last_dim_contiguous(name, t)
    num_tokens, num_heads, head_dim = query.shape
    if key.shape != value.shape or key.shape[0] != num_tokens or key.shape[2] != head_dim:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} "
                         f"must be [{num_tokens}, KH, {head_dim}]")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(f"key/value dtype {key.dtype}/{value.dtype} must equal the query's {query.dtype}")
    if num_heads % key.shape[1]:
        raise ValueError(f"{num_heads} query heads are not a multiple of {key.shape[1]} kv heads")
    for name, t in (("cu_seqlens", cu_seqlens), ("seq_ids", seq_ids)):
        check_dim(name, t, 1)
        check_int(name, t)
    if out is not None and (out.shape != query.shape or out.dtype != query.dtype or out.stride(-1) != 1):
        raise ValueError(f"out must be {tuple(query.shape)} {query.dtype} with a contiguous last dim")
    if sinks is not None:
        if sinks.shape != (num_heads,):
            raise ValueError(f"sinks must be [H={num_heads}] (one logit per query head), got {tuple(sinks.shape)}")
        check_float("sinks", sinks)
    check_same_device(query=query, key=key, value=value, cu_seqlens=cu_seqlens, seq_ids=seq_ids,
                      **({"sinks": sinks} if sinks is not None else {}))


def prefill_attention(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, KH, D] (row stride free: a view into the QKV output works)
    value: torch.Tensor,  # [T, KH, D]
    cu_seqlens: torch.Tensor,  # [S + 1] int32: sequence s owns rows [cu[s], cu[s+1]) (query_start_loc)
    seq_ids: torch.Tensor,  # [F] int32: the sequences to attend (no cached context), F <= S
    scale: float,
    max_query_len: int,  # host int bounding q_len of every listed sequence (sizes the grid)
    out: torch.Tensor | None = None,  # [T, H, D]; rows of unlisted sequences are left untouched
    sliding_window: int | None = None,  # a row at position p sees keys (p - window, p]
    sinks: torch.Tensor | None = None,  # [H] float: a per-head logit in the softmax denominator, no value
    config: PrefillTileConfig | None = None,  # launch shape override (benchmarks)
    direct_launch: bool = True,  # False: through Triton's JIT call path every time (PlannedLaunch)
) -> torch.Tensor:
    """Causal attention of each listed sequence over its own rows, position = row - cu[s].

    Equals torch_ref.paged_attention over a cache holding exactly these K/V rows (see
    `prefill_attention_ref`). Host work reads only shapes and host ints (no sync); the checks and
    launch choices are made once per input layout and metadata tensors (a step's layers share them)."""
    plan_key = (id(cu_seqlens), id(seq_ids), id(sinks), query.shape, query.stride(), query.dtype, query.device,
                key.shape, key.stride(), key.dtype, value.shape, value.stride(), value.dtype,
                None if out is None else (out.shape, out.stride(), out.dtype), scale, max_query_len,
                sliding_window, config)
    plan = _PLANS.get_or_make(plan_key, lambda: _attention_plan(
        query, key, value, cu_seqlens, seq_ids, scale, max_query_len, out, sliding_window, sinks, config))
    if out is None:
        out = torch.empty_like(query)
    _keep, layout, kwargs, kernel = plan
    if kernel is None:
        return out
    kernel((query, key, value, out),
           lambda: ((query, key, value, out, cu_seqlens, seq_ids, *layout, out.stride(0), out.stride(1)), kwargs),
           direct_launch)
    return out


_PLANS = LaunchPlans()  # prefill_attention's, by its inputs (see above)
_ATTENTION_PER_CALL = ("q_ptr", "k_ptr", "v_ptr", "out_ptr")


def _attention_plan(query, key, value, cu_seqlens, seq_ids, scale, max_query_len, out, sliding_window, sinks,
                    config) -> tuple:
    """Validate, then fix the grid and every launch argument but the per-layer tensors (kernel None: no
    launch). The plan keeps the metadata tensors whose ids are in its key, so those ids are not reused."""
    _check_args(query, key, value, cu_seqlens, seq_ids, out, sinks)
    keep = (cu_seqlens, seq_ids, sinks)
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = key.shape[1]
    if query.shape[0] == 0 or seq_ids.shape[0] == 0 or max_query_len <= 0:
        return keep, None, None, None
    group = num_heads // num_kv_heads
    group_p = next_pow2(group)
    cfg = config or default_tile_config(head_dim)
    block_m = max(cfg.block_m, 16, group_p)
    block_q = block_m // group_p
    num_q_blocks = triton.cdiv(max_query_len, block_q)
    grid = (num_q_blocks * seq_ids.shape[0] * num_kv_heads,)
    layout = (scale * LOG2E, seq_ids.shape[0], num_q_blocks, query.stride(0), query.stride(1), key.stride(0),
              key.stride(1), value.stride(0), value.stride(1))
    kwargs = dict(
        NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_P=group_p,
        HEAD_DIM=head_dim, BLOCK_D=max(16, next_pow2(head_dim)),
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=cfg.block_n,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else None,
        DOT_IN_FP32=_INTERPRETED and query.dtype == torch.bfloat16,
        window=sliding_window or 0, HAS_WINDOW=sliding_window is not None,
        sinks_ptr=sinks, HAS_SINKS=sinks is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return keep, layout, kwargs, PlannedLaunch(_prefill_attention_kernel, grid, _ATTENTION_PER_CALL)


def prefill_attention_ref(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, seq_ids: torch.Tensor,
    scale: float, max_query_len: int, out: torch.Tensor | None = None, sliding_window: int | None = None,
    sinks: torch.Tensor | None = None, config: PrefillTileConfig | None = None,
) -> torch.Tensor:
    """The contract in torch: each listed sequence's rows, written into a fresh paged cache (one
    block per sequence), through torch_ref.paged_attention. CPU tensors."""
    from atom_core.kernels import torch_ref

    out = torch.empty_like(query) if out is None else out
    for seq in seq_ids.tolist():
        lo, hi = int(cu_seqlens[seq]), int(cu_seqlens[seq + 1])
        if hi == lo:
            continue
        cache_k, cache_v = key[lo:hi].unsqueeze(0).contiguous(), value[lo:hi].unsqueeze(0).contiguous()
        one = torch.tensor([0, hi - lo], dtype=torch.int32)
        out[lo:hi] = torch_ref.paged_attention(
            query[lo:hi], cache_k, cache_v, torch.zeros(1, 1, dtype=torch.int32), one, one[1:], scale,
            hi - lo, hi - lo, sliding_window=sliding_window, sinks=sinks)
    return out
