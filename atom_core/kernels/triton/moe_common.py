"""Triton pieces every tiled fused-MoE GEMM shares (moe.py bf16, moe_fp8, moe_w4a16, moe_mxfp4).

A program owns BLOCK_M rows of the expert-aligned assignment list (moe_routing: every BLOCK_M rows
share one expert; pad rows hold ids >= num_assignments) and BLOCK_N output columns. GEMM1 writes
its rows in aligned order; GEMM2 weights each row by its top-k weight and writes it at its flat id
t*K + k. The format-specific part of each kernel (operand loads, dequantization, the dot) stays in
its own file. These helpers are inlined by Triton: the kernels compile to the same PTX as when the
lines were written out in each kernel. check_routing is the host-side check of the routing
tensors every fused-MoE entry point takes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_core.kernels.triton.common import check_int
from atom_core.kernels.triton.moe_routing import moe_align_block_size


@triton.jit
def block_rows(pid_m, sorted_ptr, expert_ids_ptr, BLOCK_M: tl.constexpr):
    """The block's aligned rows [BLOCK_M], their flat ids t*K + k (pad rows: >= num_assignments)
    and the block's expert (int64, for pointer arithmetic)."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    flat = tl.load(sorted_ptr + rows)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    return rows, flat, expert


@triton.jit
def block_token_rows(pid_m, sorted_ptr, expert_ids_ptr, num_assignments, TOP_K: tl.constexpr,
                     BLOCK_M: tl.constexpr):
    """GEMM1's view of the block: its aligned rows, the token each row gathers (int64) and the
    expert. Pad rows gather token 0 and are stored too, so the next launch never reads unwritten
    memory. The expert is loaded after the tokens, as the kernels had it (same PTX order)."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    flat = tl.load(sorted_ptr + rows)
    token = tl.where(flat < num_assignments, flat // TOP_K, 0).to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    return rows, token, expert


@triton.jit
def tile_cols(pid_n, N: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tile's output columns [BLOCK_N] and the weight rows they read: columns past N wrap onto
    real rows (unmasked loads) and are never stored."""
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return cols, cols % N


@triton.jit
def store_aligned_rows(out_ptr, vals, rows, cols, stride_ot, N: tl.constexpr):
    """GEMM1 epilogue: vals [BLOCK_M, BLOCK_N] (float32) rounded once to out's dtype at the block's
    aligned rows, pad rows included; columns past N (wrapped onto real ones by the loads) are dropped."""
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_ot + cols[None, :]
    tl.store(out_ptrs, vals.to(out_ptr.dtype.element_ty), mask=(cols < N)[None, :])


@triton.jit
def store_weighted_rows(out_ptr, acc, topk_weights_ptr, flat, row_ok, cols, stride_ot, N: tl.constexpr):
    """GEMM2 epilogue: acc [BLOCK_M, BLOCK_N] (float32) times each row's top-k weight, rounded once
    and stored at row t*K + k (the row's flat id); pad rows and columns past N are not stored."""
    acc *= tl.load(topk_weights_ptr + flat, mask=row_ok, other=0.0)[:, None]
    out_ptrs = out_ptr + flat.to(tl.int64)[:, None] * stride_ot + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < N)[None, :])


def check_routing(topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_tokens: int) -> None:
    """topk_weights float32 and topk_ids integer, both [T, K] and contiguous: the kernels read them
    by flat assignment id t*K + k."""
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"need topk_weights and topk_ids [T={num_tokens}, K], got {tuple(topk_weights.shape)} "
                         f"and {tuple(topk_ids.shape)}")
    check_int("topk_ids", topk_ids)
    if topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights must be float32, got {topk_weights.dtype}")
    if not (topk_ids.is_contiguous() and topk_weights.is_contiguous()):
        raise ValueError("topk_weights and topk_ids must be contiguous")


def grouped_launch_setup(topk_ids: torch.Tensor, cfg, num_experts: int, group_size: int, inter: int,
                         hidden: torch.Tensor, fmt: str):
    """Host side of a tiled MoE launch over group-scaled weights (block FP8, W4A16): tiles whose
    block_k divides the scale group, the expert-aligned assignment list, its block count and
    GEMM1's output buffer [aligned rows, inter] in hidden's dtype."""
    for tile in (cfg.gemm1, cfg.gemm2):
        if tile.block_k < 16 or group_size % tile.block_k:
            raise ValueError(f"{fmt} MoE tiles need block_k >= 16 dividing the group size {group_size}, "
                             f"got {tile.block_k}")
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, cfg.block_m, num_experts)
    num_m = triton.cdiv(sorted_ids.shape[0], cfg.block_m)
    return sorted_ids, expert_ids, num_post, num_m, hidden.new_empty((sorted_ids.shape[0], inter))
