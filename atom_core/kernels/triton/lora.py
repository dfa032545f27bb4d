"""Batched LoRA shrink and expand (Punica/SGMV style): the grid's last axis is the adapter slot, and
each program takes a block of that slot's tokens from the grouped layout (LoRAMeta.sorted_token_ids),
so one launch serves every adapter in the step and a slot with fewer tokens than the block's start
exits at once. The grid depends on the token count and the table shapes only: the layout lives in
persistent buffers and a CUDA graph replays any mix of adapters. References: kernels/lora_ref.py.

shrink: v [SPLIT_K, T, N] float32, one partial product per slice of K, each written by plain stores,
so v needs no zeroing launch and no atomics. A decode step has a few tokens per slot: the work is a
stream of the used slots' A tables (a few MB) that no loop over K should serialize, so small steps
split K into slices of SHRINK_SLICE inputs, one BLOCK_K step each (one round trip to memory per
program, every program's loads in flight at once). expand: sums the partials in one masked [SPLIT_K, M, R] load
(only its slot's rows move) while it loads v, in one launch over all output slices of a merged layer
(q/k/v, gate/up), y updated in place (each element by one program); a wide layer's programs take
several N tiles each, so that each streams some tens of KB of B instead of paying a program's fixed
cost (the row lookup, the partials) per 4 KB.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from atom_core.kernels.lora_ref import LoRAMeta
from atom_core.kernels.triton.common import check_dim, check_float, check_last_dim_contiguous, next_pow2

MAX_SLICES = 3
MAX_SPLIT_K = 32       # partials per output element that the expand sums (its v load grows with it)
SMALL_STEP_TOKENS = 256  # at most this many tokens: K is split (more tokens fill the GPU by their blocks)
SHRINK_SLICE = 512  # inputs of one K slice of a small step's shrink (down's K = 14336: 28 slices)


class ShrinkPlan(NamedTuple):
    """Tiles of one shrink launch. k_per_split: the K range of one partial (any size: the kernel
    masks at its end); split_k * k_per_split >= K."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    k_per_split: int
    num_stages: int


class ExpandPlan(NamedTuple):
    """Tiles of one expand launch: each program adds `tiles` consecutive N blocks of one output
    slice (its rows' partials summed once for all of them), a software pipeline of `num_stages`."""

    block_m: int
    block_n: int
    tiles: int
    num_stages: int


def _block_m(num_tokens: int) -> int:
    """Rows of one slot in one program. A small step: 16 (tl.dot's least), a decode batch's tokens of
    one adapter; 32 rows doubled the registers of the pointer and x tiles (compiled for sm_90: 210 a
    thread in down's shrink, 148 in the expand), leaving 2-3 programs an SM."""
    return 16 if num_tokens <= SMALL_STEP_TOKENS else 64


def shrink_plan(num_tokens: int, k: int, n: int) -> ShrinkPlan:
    """The shrink's tiles for a step of `num_tokens` rows, K = `k` inputs, N = `n` stacked ranks."""
    block_n = max(16, min(64, next_pow2(n)))
    if num_tokens > SMALL_STEP_TOKENS:
        return ShrinkPlan(_block_m(num_tokens), block_n, 128, 1, k, 3)
    # A 512-deep slice holds its A tile in registers: [512, 64] spills on sm_90 at 4 warps (q/k/v's
    # 48 stacked ranks), [512, 32] does not, so wider stacks take two or more N tiles.
    block_n = min(block_n, 32)
    # Slices of a multiple of 64 inputs keep each program's loads 16-byte aligned; 512-wide slices
    # (at most MAX_SPLIT_K of them) balance the shrink's parallelism against the partials the
    # expand must read back (lora_bench --sweep on an H200: 8 slices of 512 beat 32 of 128 for the pair).
    k_per_split = triton.cdiv(triton.cdiv(k, min(MAX_SPLIT_K, triton.cdiv(k, SHRINK_SLICE))), 64) * 64
    split_k = triton.cdiv(k, k_per_split)
    block_k = max(16, min(512, next_pow2(k_per_split)))
    # One step of K a program: a software pipeline would only stage the loads through shared memory.
    return ShrinkPlan(_block_m(num_tokens), block_n, block_k, split_k, k_per_split, 1 if block_k >= k_per_split else 3)


EXPAND_PROGRAMS = 896  # more N blocks than this are grouped in a program (gate/up at 8 slots: 2 a program,
# the sweep's best; q/k/v, o and down keep one)


def expand_plan(num_tokens: int, widths: list[int], slots: int) -> ExpandPlan:
    """The expand's tiles for `num_tokens` rows, output slices of `widths` columns and `slots`
    adapter slots. A small step: 128 columns, and as many N blocks a program as keep the programs
    of the busy slots (at most one a token) about EXPAND_PROGRAMS: gate/up's 28672 columns are 1792
    programs of one block at 8 slots, 896 of 2."""
    if num_tokens > SMALL_STEP_TOKENS:
        return ExpandPlan(_block_m(num_tokens), max(16, min(64, next_pow2(max(widths)))), 1, 1)
    block_n = max(16, min(128, next_pow2(max(widths))))
    blocks = sum(triton.cdiv(w, block_n) for w in widths) * min(slots, num_tokens)
    tiles = max(1, min(8, blocks // EXPAND_PROGRAMS))
    return ExpandPlan(_block_m(num_tokens), block_n, tiles, 1 if tiles == 1 else 2)


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, v_ptr, sorted_ptr, count_ptr, start_ptr, N, K, K_PER_SPLIT,
                        stride_xm, stride_al, stride_an, stride_vs, stride_vm,
                        SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1) // SPLIT_K
    pid_k = tl.program_id(1) % SPLIT_K
    slot = tl.program_id(2)
    count = tl.load(count_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    rows = tl.load(sorted_ptr + tl.load(start_ptr + slot) + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    a_rows = a_ptr + slot.to(tl.int64) * stride_al + offs_n[:, None] * stride_an
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_hi
        x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0)
        a = tl.load(a_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(a))
    out = v_ptr + pid_k * stride_vs + rows[:, None] * stride_vm + offs_n[None, :]
    tl.store(out, acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _lora_expand_kernel(v_ptr, b_ptr, y_ptr, sorted_ptr, count_ptr, start_ptr, o0, o1, o2, o3, RANK,
                        C1, C2, stride_vs, stride_vm, stride_bl, stride_bn, stride_ym,
                        SPLIT_K: tl.constexpr, BLOCK_S: tl.constexpr, V_CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, TILES: tl.constexpr):
    pid_m = tl.program_id(0)
    # Axis 1 runs over the groups of TILES N blocks of every output slice in turn (slice i's first
    # at C_i), so a narrow slice (k and v beside q) launches no programs that only exit.
    pid_n = tl.program_id(1)
    part = (pid_n >= C1).to(tl.int32) + (pid_n >= C2).to(tl.int32)
    block = pid_n - tl.where(part == 0, 0, tl.where(part == 1, C1, C2))
    slot = tl.program_id(2)
    count = tl.load(count_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    lo = tl.where(part == 0, o0, tl.where(part == 1, o1, o2))
    hi = tl.where(part == 0, o1, tl.where(part == 1, o2, o3))
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < RANK
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    rows = tl.load(sorted_ptr + tl.load(start_ptr + slot) + offs_m, mask=mask_m, other=0).to(tl.int64)
    # The partials in chunks of V_CHUNK slices: independent loads, all in flight, in few registers.
    v_rows = v_ptr + rows[None, :, None] * stride_vm + (part * RANK + offs_r)[None, None, :]
    v = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for s0 in tl.static_range(0, BLOCK_S, V_CHUNK):
        offs_s = s0 + tl.arange(0, V_CHUNK)
        v_mask = (offs_s < SPLIT_K)[:, None, None] & mask_m[None, :, None] & mask_r[None, None, :]
        v += tl.sum(tl.load(v_rows + offs_s[:, None, None] * stride_vs, mask=v_mask, other=0.0), axis=0)
    b_rows = b_ptr + slot.to(tl.int64) * stride_bl + offs_r[None, :]
    for tile in range(TILES):
        offs_n = lo + (block * TILES + tile) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        b = tl.load(b_rows + offs_n[:, None] * stride_bn, mask=mask_n[:, None] & mask_r[None, :], other=0.0)
        mask = mask_m[:, None] & mask_n[None, :]
        out = y_ptr + rows[:, None] * stride_ym + offs_n[None, :]
        y = tl.load(out, mask=mask, other=0.0)
        acc = tl.dot(v.to(b.dtype), tl.trans(b))
        tl.store(out, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


def _check(x: torch.Tensor, table: torch.Tensor, meta: LoRAMeta) -> None:
    check_dim("x", x, 2)
    check_dim("LoRA table", table, 3)
    check_float("x", x)
    check_last_dim_contiguous("x", x)
    if not table.is_contiguous():
        raise ValueError("a LoRA slot table must be contiguous")
    if meta.sorted_token_ids.shape[0] < x.shape[0] or meta.slot_num_tokens.shape[0] != table.shape[0]:
        raise ValueError(f"LoRA layout for {meta.sorted_token_ids.shape[0]} tokens and "
                         f"{meta.slot_num_tokens.shape[0]} slots does not fit x {tuple(x.shape)} and a table of "
                         f"{table.shape[0]} slots")


def _check_plan(plan: ShrinkPlan, k: int) -> None:
    if plan.split_k < 1 or plan.split_k * plan.k_per_split < k or plan.split_k > MAX_SPLIT_K:
        raise ValueError(f"a shrink plan of {plan.split_k} slices of {plan.k_per_split} does not cover K = {k} "
                         f"(1 to {MAX_SPLIT_K} slices)")
    if plan.num_stages < 1:
        raise ValueError(f"shrink num_stages {plan.num_stages} must be >= 1")
    for name in ("block_m", "block_n", "block_k"):
        if getattr(plan, name) < 16 or getattr(plan, name) != next_pow2(getattr(plan, name)):
            raise ValueError(f"shrink {name} {getattr(plan, name)} must be a power of two >= 16")


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, meta: LoRAMeta, plan: ShrinkPlan | None = None) -> torch.Tensor:
    """v [split_k, T, N] float32 partials of x A[slot]^T (rows of no adapter unwritten). plan: the
    tiles (default shrink_plan's; benchmarks/kernels/lora_bench.py sweeps others)."""
    _check(x, lora_a, meta)
    num_tokens, k = x.shape
    slots, n, _ = lora_a.shape
    plan = plan or shrink_plan(num_tokens, k, n)
    _check_plan(plan, k)
    v = torch.empty(plan.split_k, num_tokens, n, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return v
    grid = (triton.cdiv(num_tokens, plan.block_m), triton.cdiv(n, plan.block_n) * plan.split_k, slots)
    _lora_shrink_kernel[grid](x, lora_a, v, meta.sorted_token_ids, meta.slot_num_tokens, meta.slot_start, n, k,
                              plan.k_per_split, x.stride(0), lora_a.stride(0), lora_a.stride(1), v.stride(0),
                              v.stride(1), SPLIT_K=plan.split_k, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
                              BLOCK_K=plan.block_k, num_stages=plan.num_stages)
    return v


def lora_expand(y: torch.Tensor, v: torch.Tensor, lora_b: torch.Tensor, meta: LoRAMeta,
                slice_offsets: tuple[int, ...], rank: int, plan: ExpandPlan | None = None) -> None:
    _check(y, lora_b, meta)
    num_slices = len(slice_offsets) - 1
    if not 1 <= num_slices <= MAX_SLICES or slice_offsets[-1] != y.shape[1]:
        raise ValueError(f"slice_offsets {slice_offsets} must hold 1 to {MAX_SLICES} slices ending at y's width "
                         f"{y.shape[1]}")
    if (v.dtype != torch.float32 or v.dim() != 3 or v.shape[1:] != (y.shape[0], num_slices * rank)
            or not 1 <= v.shape[0] <= MAX_SPLIT_K):
        raise ValueError(f"v must be float32 [1 to {MAX_SPLIT_K} splits, {y.shape[0]}, {num_slices * rank}]; got "
                         f"{v.dtype} {tuple(v.shape)}")
    if y.shape[0] == 0:
        return
    widths = [hi - lo for lo, hi in zip(slice_offsets[:-1], slice_offsets[1:])]
    if min(widths) < 1:
        raise ValueError(f"slice_offsets {slice_offsets} must increase")
    plan = plan or expand_plan(y.shape[0], widths, lora_b.shape[0])
    if (min(plan.block_m, plan.block_n) < 16 or plan.block_m != next_pow2(plan.block_m)
            or plan.block_n != next_pow2(plan.block_n) or plan.tiles < 1 or plan.num_stages < 1):
        raise ValueError(f"expand plan {tuple(plan)}: blocks must be powers of two >= 16, tiles and stages >= 1")
    firsts = [0]  # each slice's first group of N blocks on the grid's axis 1, then the total
    for width in widths:
        firsts.append(firsts[-1] + triton.cdiv(width, plan.block_n * plan.tiles))
    starts = firsts[1:-1] + [firsts[-1]] * (MAX_SLICES - num_slices)
    bounds = list(slice_offsets) + [slice_offsets[-1]] * (MAX_SLICES + 1 - len(slice_offsets))
    grid = (triton.cdiv(y.shape[0], plan.block_m), firsts[-1], lora_b.shape[0])
    _lora_expand_kernel[grid](v, lora_b, y, meta.sorted_token_ids, meta.slot_num_tokens, meta.slot_start, *bounds,
                              rank, *starts, v.stride(0), v.stride(1), lora_b.stride(0), lora_b.stride(1), y.stride(0),
                              SPLIT_K=v.shape[0], BLOCK_S=next_pow2(v.shape[0]),
                              V_CHUNK=min(8, next_pow2(v.shape[0])), BLOCK_M=plan.block_m,
                              BLOCK_N=plan.block_n, BLOCK_R=max(16, next_pow2(rank)), TILES=plan.tiles,
                              num_stages=plan.num_stages)
