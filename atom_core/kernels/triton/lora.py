"""Batched LoRA shrink and expand (Punica/SGMV style): the grid's last axis is the adapter slot, and
each program takes a block of that slot's tokens from the grouped layout (LoRAMeta.sorted_token_ids),
so one launch serves every adapter in the step and a slot with fewer tokens than the block's start
exits at once. The grid depends on the token count and the table shapes only: the layout lives in
persistent buffers and a CUDA graph replays any mix of adapters. References: kernels/lora_ref.py.

shrink: v [SPLIT_K, T, N] float32, one partial product per slice of K (a decode step has few tokens
per slot; splitting K gives the GPU enough programs to stream A), each written by plain stores, so v
needs no zeroing launch and no atomics. expand: sums the partials while it loads v, in one launch over
all output slices of a merged layer (q/k/v, gate/up), y updated in place (each element by one program).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_core.kernels.lora_ref import LoRAMeta
from atom_core.kernels.triton.common import check_dim, check_float, check_last_dim_contiguous, next_pow2

SHRINK_BLOCK_M = 16
SHRINK_BLOCK_K = 128
EXPAND_BLOCK_M = 16
EXPAND_BLOCK_N = 64
MAX_SLICES = 3


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
    for k0 in range(k_lo, k_lo + K_PER_SPLIT, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0)
        a = tl.load(a_ptr + slot.to(tl.int64) * stride_al + offs_n[:, None] * stride_an + offs_k[None, :],
                    mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(a))
    out = v_ptr + pid_k * stride_vs + rows[:, None] * stride_vm + offs_n[None, :]
    tl.store(out, acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _lora_expand_kernel(v_ptr, b_ptr, y_ptr, sorted_ptr, count_ptr, start_ptr, o0, o1, o2, o3, RANK,
                        BLOCKS_PER_SLICE, stride_vs, stride_vm, stride_bl, stride_bn, stride_ym,
                        SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    pid_m = tl.program_id(0)
    part = tl.program_id(1) // BLOCKS_PER_SLICE  # the output slice
    block = tl.program_id(1) % BLOCKS_PER_SLICE
    slot = tl.program_id(2)
    count = tl.load(count_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    lo = tl.where(part == 0, o0, tl.where(part == 1, o1, o2))
    hi = tl.where(part == 0, o1, tl.where(part == 1, o2, o3))
    offs_n = lo + block * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hi
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    rows = tl.load(sorted_ptr + tl.load(start_ptr + slot) + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < RANK
    v_rows = v_ptr + rows[:, None] * stride_vm + part * RANK + offs_r[None, :]
    v = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        v += tl.load(v_rows + split * stride_vs, mask=mask_m[:, None] & mask_r[None, :], other=0.0)
    b = tl.load(b_ptr + slot.to(tl.int64) * stride_bl + offs_n[:, None] * stride_bn + offs_r[None, :],
                mask=mask_n[:, None] & mask_r[None, :], other=0.0)
    acc = tl.dot(v.to(b.dtype), tl.trans(b))
    mask = mask_m[:, None] & mask_n[None, :]
    out = y_ptr + rows[:, None] * stride_ym + offs_n[None, :]
    y = tl.load(out, mask=mask, other=0.0)
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


def shrink_split_k(num_tokens: int, k: int) -> int:
    """K slices of the shrink: few tokens leave most of the GPU idle unless K is split."""
    if num_tokens > 256:
        return 1
    return max(1, min(8, k // (4 * SHRINK_BLOCK_K)))


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, meta: LoRAMeta) -> torch.Tensor:
    _check(x, lora_a, meta)
    num_tokens, k = x.shape
    slots, n, _ = lora_a.shape
    split_k = shrink_split_k(num_tokens, k)
    v = torch.empty(split_k, num_tokens, n, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return v
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), SHRINK_BLOCK_K) * SHRINK_BLOCK_K
    block_n = max(16, min(64, next_pow2(n)))
    grid = (triton.cdiv(num_tokens, SHRINK_BLOCK_M), triton.cdiv(n, block_n) * split_k, slots)
    _lora_shrink_kernel[grid](x, lora_a, v, meta.sorted_token_ids, meta.slot_num_tokens, meta.slot_start, n, k,
                              k_per_split, x.stride(0), lora_a.stride(0), lora_a.stride(1), v.stride(0), v.stride(1),
                              SPLIT_K=split_k, BLOCK_M=SHRINK_BLOCK_M, BLOCK_N=block_n, BLOCK_K=SHRINK_BLOCK_K)
    return v


def lora_expand(y: torch.Tensor, v: torch.Tensor, lora_b: torch.Tensor, meta: LoRAMeta,
                slice_offsets: tuple[int, ...], rank: int) -> None:
    _check(y, lora_b, meta)
    num_slices = len(slice_offsets) - 1
    if not 1 <= num_slices <= MAX_SLICES or slice_offsets[-1] != y.shape[1]:
        raise ValueError(f"slice_offsets {slice_offsets} must hold 1 to {MAX_SLICES} slices ending at y's width "
                         f"{y.shape[1]}")
    if v.dtype != torch.float32 or v.dim() != 3 or v.shape[1:] != (y.shape[0], num_slices * rank):
        raise ValueError(f"v must be float32 [splits, {y.shape[0]}, {num_slices * rank}]; got {v.dtype} "
                         f"{tuple(v.shape)}")
    if y.shape[0] == 0:
        return
    widest = max(hi - lo for lo, hi in zip(slice_offsets[:-1], slice_offsets[1:]))
    blocks = triton.cdiv(widest, EXPAND_BLOCK_N)
    bounds = list(slice_offsets) + [slice_offsets[-1]] * (MAX_SLICES + 1 - len(slice_offsets))
    grid = (triton.cdiv(y.shape[0], EXPAND_BLOCK_M), blocks * num_slices, lora_b.shape[0])
    _lora_expand_kernel[grid](v, lora_b, y, meta.sorted_token_ids, meta.slot_num_tokens, meta.slot_start, *bounds,
                              rank, blocks, v.stride(0), v.stride(1), lora_b.stride(0), lora_b.stride(1), y.stride(0),
                              SPLIT_K=v.shape[0], BLOCK_M=EXPAND_BLOCK_M, BLOCK_N=EXPAND_BLOCK_N, BLOCK_R=max(16, next_pow2(rank)))
