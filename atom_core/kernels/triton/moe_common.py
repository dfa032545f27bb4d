"""Triton pieces every fused-MoE kernel shares (moe.py bf16, moe_fp8, moe_w4a16, moe_mxfp4 and the
decode GEMVs): the tile configs, the activation, and the grouped-GEMM prologue and epilogues.

A program owns BLOCK_M rows of the expert-aligned assignment list (moe_routing: every BLOCK_M rows
share one expert; pad rows hold ids >= num_assignments) and BLOCK_N output columns. GEMM1 writes
its rows in aligned order; GEMM2 weights each row by its top-k weight and writes it at its flat id
t*K + k. The format-specific part of each kernel (operand loads, dequantization, the dot) stays in
its own file. These helpers are inlined by Triton: the kernels compile to the same PTX as when the
lines were written out in each kernel. check_routing is the host-side check of the routing
tensors every fused-MoE entry point takes.

A tiled kernel opens with
    pid_m, pid_n, past_end = grouped_tile(num_m_blocks, num_post_ptr, N, BLOCK_M, BLOCK_N, GROUP_M)
    if past_end:
        return
    rows, token, expert, cols, offs_n = gemm1_tile(...)     # or gemm2_tile for the down projection
An activation is a code in ACTIVATIONS and a branch in `activate`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from atom_core.kernels.moe_ref import SWIGLU_ALPHA
from atom_core.kernels.triton.common import check_int
from atom_core.kernels.triton.moe_routing import moe_align_block_size
from atom_core.kernels.triton.tiles import INTERPRETED, tile_ids

ACTIVATIONS = {"silu": 0, "swigluoai": 1}  # name -> the `activate` code
_SWIGLU_ALPHA = tl.constexpr(SWIGLU_ALPHA)


@dataclass(frozen=True)
class GemmTile:
    block_n: int
    block_k: int
    group_m: int  # m blocks that sweep the n tiles together, so B tiles are reused from L2
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoeConfig:
    block_m: int  # also the alignment block size: both GEMMs share the aligned list
    gemm1: GemmTile
    gemm2: GemmTile

    @classmethod
    def from_json(cls, d: dict) -> "MoeConfig":
        return cls(d["block_m"], GemmTile(**d["gemm1"]), GemmTile(**d["gemm2"]))


@triton.jit
def activate(gate, up, limit, ACTIVATION: tl.constexpr):
    """float32 gate/up tiles -> the activation (moe_ref.apply_activation); `limit` is read by swigluoai only."""
    if ACTIVATION == 0:  # silu(gate) * up
        return gate * tl.sigmoid(gate) * up
    elif ACTIVATION == 1:  # swigluoai: (clamp(up, -l, l) + 1) * g * sigmoid(alpha * g), g = min(gate, l)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        return (up + 1.0) * (gate * tl.sigmoid(gate * _SWIGLU_ALPHA))
    else:
        tl.static_assert(False, "unknown activation code")


def dot_args(dtype: torch.dtype) -> dict:
    """The tl.dot options of the bf16/fp16/fp32 and weight-only GEMMs: float32 stays IEEE (Triton
    would use TF32) so the fp32 path matches the reference; Triton's CPU interpreter multiplies bf16
    dot operands as raw uint16 (see attention.py), so there, and only there, they are upcast first."""
    return {"DOT_PRECISION": "ieee" if dtype == torch.float32 else None,
            "DOT_IN_FP32": INTERPRETED and dtype == torch.bfloat16}


@triton.jit
def grouped_tile(num_m_blocks, num_post_ptr, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 GROUP_M: tl.constexpr):
    """This program's m block and n tile (grouped order over N columns) and whether the m block lies
    past the used prefix of the aligned list (num_tokens_post_padded): then the kernel returns at once."""
    pid_m, pid_n = tile_ids(num_m_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    return pid_m, pid_n, pid_m * BLOCK_M >= tl.load(num_post_ptr)


@triton.jit
def gemm1_tile(pid_m, pid_n, sorted_ptr, expert_ids_ptr, num_assignments, N: tl.constexpr, TOP_K: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """GEMM1's tile: block_token_rows (rows, the tokens they gather, the expert) and tile_cols."""
    rows, token, expert = block_token_rows(pid_m, sorted_ptr, expert_ids_ptr, num_assignments, TOP_K, BLOCK_M)
    cols, offs_n = tile_cols(pid_n, N, BLOCK_N)
    return rows, token, expert, cols, offs_n


@triton.jit
def gemm2_tile(pid_m, pid_n, sorted_ptr, expert_ids_ptr, num_assignments, N: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """GEMM2's tile: block_rows (rows, their flat ids, the expert), which rows are real assignments
    (row_ok) and tile_cols."""
    rows, flat, expert = block_rows(pid_m, sorted_ptr, expert_ids_ptr, BLOCK_M)
    row_ok = flat < num_assignments
    cols, offs_n = tile_cols(pid_n, N, BLOCK_N)
    return rows, flat, row_ok, expert, cols, offs_n


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
