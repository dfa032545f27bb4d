"""Mixture-of-experts (Triton): routing, block alignment, and the expert MLPs as grouped GEMMs.
Same contracts as `kernels/moe_ref.py` (shape names T, E, K, H, I are defined there).

fused_moe, launch by launch (static shapes, no host sync: CUDA-graph and torch.compile safe)
  1. Alignment: the T*K (token, slot) assignments sorted by expert, each expert's run padded to
     a multiple of BLOCK_M, so every BLOCK_M rows of the list share one expert. One launch up to
     ALIGN_MAX_CHUNK assignments; past that a histogram launch per chunk first. The scatter
     sorts (expert, position) keys inside a chunk, so the order is ascending within an expert
     and identical to the reference: the whole pipeline is deterministic.
  2. GEMM1, one launch over all experts: a program takes BLOCK_M aligned rows and BLOCK_N of the
     I columns, gathers the rows' tokens from `hidden`, multiplies them by the gate and the up
     tile of the block's expert (two accumulators) and applies silu(gate) * up in the epilogue,
     writing [rows, I] in aligned order. Fused rather than a separate silu_and_mul launch: that
     saves a launch and the [T*K, 2I] write and re-read, which should win at every batch
     size; the cost is the second accumulator, which the tuned BLOCK_N absorbs.
  3. GEMM2: aligned activation rows (contiguous) times w2[e]; the epilogue adds the bias,
     multiplies by the row's top-k weight and writes row t*K + k of a [T*K, H] buffer.
  4. Sum: out[t] = sum_k buffer[t*K + k] in float32, cast once. A buffer and a second pass
     instead of float32 atomics: same bits every run, and no zero-fill or cast launch.
Grids are sized from host ints only (T, K, E, BLOCK_M); programs past the used prefix of the
aligned list read num_tokens_post_padded and return at once.

Tile configs come from moe_configs/E={E},N={I},K={H},dtype={dtype},device={name}.json (written
by `python -m benchmarks.kernels.tune_moe`), a table from token count to MoeConfig; without a
file, default_moe_config. An activation is a code in ACTIVATIONS and a branch in moe_common.activate
(silu, and GPT-OSS's clamped "swigluoai" with its `limit` a runtime argument); quantized weights
would add scale pointers to the two GEMMs' B-tile loads.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Optional

import torch
import triton
import triton.language as tl

from atom_core.kernels.moe_ref import check_activation
from atom_core.kernels.triton import moe_decode
from atom_core.kernels.triton.moe_common import (  # noqa: F401  (ACTIVATIONS, GemmTile: part of the MoE API)
    ACTIVATIONS, GemmTile, MoeConfig, activate, check_routing, dot_args, gemm1_tile, gemm2_tile, grouped_tile,
    store_aligned_rows, store_weighted_rows,
)
from atom_core.kernels.triton.common import (
    check_dim, check_float, check_last_dim_contiguous, check_same_device, next_pow2,
)

# Routing and alignment live beside this file; re-exported so one module holds the MoE API.
from atom_core.kernels.triton.moe_routing import launch_moe_align, moe_align_block_size, moe_route  # noqa: E402,F401

CONFIG_DIR = Path(__file__).with_name("moe_configs")
SUM_BLOCK_H = 1024


# ---------------------------------------------------------------------------------------------
# expert GEMMs


@triton.jit(do_not_specialize=["num_assignments", "num_m_blocks"])
def _gemm1_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
    num_assignments, num_m_blocks, stride_xt, stride_we, stride_wn, stride_be, stride_ot, limit,
    INTER: tl.constexpr, HIDDEN: tl.constexpr, TOP_K: tl.constexpr, ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):
    """act(x[tokens] @ w13[e].T) for BLOCK_M aligned rows x BLOCK_N columns of I."""
    pid_m, pid_n, past_end = grouped_tile(num_m_blocks, num_post_ptr, INTER, BLOCK_M, BLOCK_N, GROUP_M)
    if past_end:
        return
    rows, token, expert, cols, offs_n = gemm1_tile(pid_m, pid_n, sorted_ptr, expert_ids_ptr, num_assignments, INTER,
                                                   TOP_K, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :]
    g_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + INTER * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        if HIDDEN % BLOCK_K == 0:
            a = tl.load(a_ptrs)
            wg = tl.load(g_ptrs)
            wu = tl.load(u_ptrs)
        else:
            k_ok = offs_k < HIDDEN - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            wg = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
            wu = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
        if DOT_IN_FP32:
            a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        acc_g = tl.dot(a, wg, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(a, wu, acc_u, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if HAS_BIAS:
        b_ptrs = bias_ptr + expert * stride_be + offs_n
        acc_g += tl.load(b_ptrs).to(tl.float32)[None, :]
        acc_u += tl.load(b_ptrs + INTER).to(tl.float32)[None, :]
    act = activate(acc_g, acc_u, limit, ACTIVATION)
    store_aligned_rows(out_ptr, act, rows, cols, stride_ot, INTER)


@triton.jit(do_not_specialize=["num_assignments", "num_m_blocks"])
def _gemm2_kernel(
    a_ptr, w_ptr, bias_ptr, topk_weights_ptr, out_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
    num_assignments, num_m_blocks, stride_at, stride_we, stride_wn, stride_be, stride_ot,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):
    """topk_weight * (act[rows] @ w2[e].T + b2) for BLOCK_M aligned rows x BLOCK_N columns of H,
    stored at the rows' flat ids t*K + k."""
    pid_m, pid_n, past_end = grouped_tile(num_m_blocks, num_post_ptr, HIDDEN, BLOCK_M, BLOCK_N, GROUP_M)
    if past_end:
        return
    rows, flat, row_ok, expert, cols, offs_n = gemm2_tile(pid_m, pid_n, sorted_ptr, expert_ids_ptr, num_assignments,
                                                          HIDDEN, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_at + offs_k[None, :]
    b_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        if INTER % BLOCK_K == 0:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = offs_k < INTER - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        if DOT_IN_FP32:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + offs_n).to(tl.float32)[None, :]
    store_weighted_rows(out_ptr, acc, topk_weights_ptr, flat, row_ok, cols, stride_ot, HIDDEN)


@triton.jit
def _sum_kernel(partial_ptr, ids_ptr, out_ptr, stride_ot, HIDDEN: tl.constexpr, TOP_K: tl.constexpr,
                K_P: tl.constexpr, NUM_EXPERTS: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = sum of the K partial rows of token t that an expert wrote (float32)."""
    token = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    k = tl.arange(0, K_P)
    e = tl.load(ids_ptr + token * TOP_K + k, mask=k < TOP_K, other=-1)
    written = (e >= 0) & (e < NUM_EXPERTS)
    h_ok = h < HIDDEN
    vals = tl.load(partial_ptr + (token * TOP_K + k)[:, None] * HIDDEN + h[None, :],
                   mask=written[:, None] & h_ok[None, :], other=0.0)
    tl.store(out_ptr + token * stride_ot + h, tl.sum(vals.to(tl.float32), 0).to(out_ptr.dtype.element_ty), mask=h_ok)


def moe_gemm1(hidden: torch.Tensor, w13: torch.Tensor, w13_bias: Optional[torch.Tensor], sorted_ids: torch.Tensor,
              expert_ids: torch.Tensor, num_post: torch.Tensor, top_k: int, block_m: int, tile: GemmTile,
              out: torch.Tensor, activation: str = "silu", swiglu_limit: float | None = None) -> torch.Tensor:
    """GEMM1 stage: out [max_padded, I] in aligned order; every row of a used block is written."""
    inter, num_assignments = w13.shape[1] // 2, hidden.shape[0] * top_k
    num_m = triton.cdiv(sorted_ids.shape[0], block_m)
    grid = (num_m * triton.cdiv(inter, tile.block_n),)
    _gemm1_kernel[grid](
        hidden, w13, w13_bias if w13_bias is not None else w13, out, sorted_ids, expert_ids, num_post,
        num_assignments, num_m, hidden.stride(0), w13.stride(0), w13.stride(1),
        w13_bias.stride(0) if w13_bias is not None else 0, out.stride(0), float(swiglu_limit or 0.0),
        INTER=inter, HIDDEN=hidden.shape[1], TOP_K=top_k, ACTIVATION=ACTIVATIONS[activation],
        HAS_BIAS=w13_bias is not None, BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        GROUP_M=tile.group_m, num_warps=tile.num_warps, num_stages=tile.num_stages, **dot_args(hidden.dtype),
    )
    return out


def moe_gemm2(act: torch.Tensor, w2: torch.Tensor, w2_bias: Optional[torch.Tensor], topk_weights: torch.Tensor,
              sorted_ids: torch.Tensor, expert_ids: torch.Tensor, num_post: torch.Tensor, block_m: int,
              tile: GemmTile, out: torch.Tensor) -> torch.Tensor:
    """GEMM2 stage: out [T*K, H], row t*K + k = weighted expert output (rows of dropped ids unwritten)."""
    hidden_size = w2.shape[1]
    num_m = triton.cdiv(sorted_ids.shape[0], block_m)
    grid = (num_m * triton.cdiv(hidden_size, tile.block_n),)
    _gemm2_kernel[grid](
        act, w2, w2_bias if w2_bias is not None else w2, topk_weights, out, sorted_ids, expert_ids, num_post,
        topk_weights.numel(), num_m, act.stride(0), w2.stride(0), w2.stride(1),
        w2_bias.stride(0) if w2_bias is not None else 0, out.stride(0),
        HIDDEN=hidden_size, INTER=w2.shape[2], HAS_BIAS=w2_bias is not None, BLOCK_M=block_m,
        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **dot_args(act.dtype),
    )
    return out


def moe_sum(partial: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, out: torch.Tensor) -> torch.Tensor:
    """Sum stage: out [T, H] = per-token float32 sum of the [T*K, H] partial rows."""
    num_tokens, top_k = topk_ids.shape
    hidden_size = out.shape[1]
    block_h = min(SUM_BLOCK_H, next_pow2(hidden_size))
    _sum_kernel[(num_tokens, triton.cdiv(hidden_size, block_h))](
        partial, topk_ids, out, out.stride(0), HIDDEN=hidden_size, TOP_K=top_k, K_P=next_pow2(top_k),
        NUM_EXPERTS=num_experts, BLOCK_H=block_h, num_warps=4,
    )
    return out


# ---------------------------------------------------------------------------------------------
# tile configs


def default_moe_config(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype) -> MoeConfig:
    """Config when no tuned table exists, by the average rows per expert. The tiers generalise
    the tuned tables in moe_configs/ (Qwen3-30B-A3B and Mixtral-8x7B shapes, bf16)."""
    rows_per_expert = num_tokens * top_k / num_experts
    if rows_per_expert <= 8:  # decode: weight-bandwidth bound; long K tiles, narrow N for more programs
        cfg = MoeConfig(16, GemmTile(32, 256, 1, 4, 4), GemmTile(64, 256, 1, 4, 4))
    elif rows_per_expert <= 32:
        cfg = MoeConfig(32, GemmTile(128, 128, 1, 4, 3), GemmTile(128, 128, 1, 4, 3))
    elif rows_per_expert <= 128:
        cfg = MoeConfig(64, GemmTile(128, 64, 1, 4, 4), GemmTile(128, 64, 1, 4, 4))
    else:  # prefill: compute bound
        cfg = MoeConfig(128, GemmTile(128, 64, 16, 8, 4), GemmTile(256, 64, 1, 8, 4))
    if dtype == torch.float32:  # 4-byte operands: keep the pipelined tiles within shared memory
        cfg = MoeConfig(cfg.block_m, *(GemmTile(t.block_n, min(t.block_k, 32), t.group_m, t.num_warps,
                                                min(t.num_stages, 3)) for t in (cfg.gemm1, cfg.gemm2)))
    return cfg


@functools.lru_cache(maxsize=None)
def device_name(device: torch.device | str) -> str:
    """The name config files are keyed by, e.g. NVIDIA_H100_80GB_HBM3; 'cpu' off the GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    return torch.cuda.get_device_name(device).replace(" ", "_")


def config_file_name(num_experts: int, hidden_size: int, inter: int, dtype: torch.dtype, device: str) -> str:
    """N and K name the expert's own GEMM dims: N = I (intermediate), K = H (hidden)."""
    return f"E={num_experts},N={inter},K={hidden_size},dtype={str(dtype).removeprefix('torch.')},device={device}.json"


@functools.lru_cache(maxsize=None)
def load_config_table(path: Path) -> tuple[dict[int, MoeConfig], int | None] | None:
    """(configs by token count, the top_k they were tuned at), or None without a file. Format:
    {"meta": {"top_k": K, ...}, "configs": {"<tokens>": {"block_m", "gemm1": {...}, "gemm2": {...}}}}."""
    if not path.is_file():
        return None
    table = json.loads(path.read_text())
    try:
        configs = {int(m): MoeConfig.from_json(c) for m, c in table["configs"].items()}
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed MoE config table {path}: {exc!r}") from exc
    return configs, table.get("meta", {}).get("top_k")


def get_moe_config(num_experts: int, hidden_size: int, inter: int, top_k: int, dtype: torch.dtype,
                   num_tokens: int, device: torch.device | str, config_dir: Path | None = None) -> MoeConfig:
    """The tuned entry nearest to num_tokens (scaled to the top_k the table was tuned at: the
    GEMMs' shapes depend on T*K), else default_moe_config."""
    name = config_file_name(num_experts, hidden_size, inter, dtype, device_name(device))
    loaded = load_config_table(Path(config_dir or CONFIG_DIR) / name)
    if not loaded:
        return default_moe_config(num_tokens, top_k, num_experts, dtype)
    configs, tuned_top_k = loaded
    tokens = num_tokens * top_k / (tuned_top_k or top_k)
    return configs[min(configs, key=lambda m: (abs(m - tokens), m))]


# ---------------------------------------------------------------------------------------------
# fused_moe


def _check_moe_args(hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, swiglu_limit) -> None:
    check_activation(activation, swiglu_limit)
    check_dim("hidden", hidden, 2)
    check_dim("w13", w13, 3)
    check_dim("w2", w2, 3)
    check_float("hidden", hidden)
    num_tokens, hidden_size = hidden.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    if w13.shape != (num_experts, 2 * inter, hidden_size) or w2.shape != (num_experts, hidden_size, inter):
        raise ValueError(f"need w13 [E, 2I, H] and w2 [E, H, I] with H={hidden_size}, got {tuple(w13.shape)} "
                         f"and {tuple(w2.shape)}")
    if w13.dtype != hidden.dtype or w2.dtype != hidden.dtype:
        raise ValueError(f"w13 {w13.dtype} and w2 {w2.dtype} must have hidden's dtype {hidden.dtype}")
    check_routing(topk_weights, topk_ids, num_tokens)
    biases = (("w13_bias", w13_bias, (num_experts, 2 * inter)), ("w2_bias", w2_bias, (num_experts, hidden_size)))
    for name, t, shape in biases:
        if t is not None:
            if t.shape != shape:
                raise ValueError(f"{name} must be {list(shape)}, got {tuple(t.shape)}")
            check_float(name, t)
            check_last_dim_contiguous(name, t)
    for name, t in (("hidden", hidden), ("w13", w13), ("w2", w2)):
        check_last_dim_contiguous(name, t)
    check_same_device(hidden=hidden, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)


def launch_fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, activation: str = "silu", w13_bias: Optional[torch.Tensor] = None,
                     w2_bias: Optional[torch.Tensor] = None, swiglu_limit: Optional[float] = None, *,
                     config: MoeConfig | None = None, out: torch.Tensor | None = None,
                     path: moe_decode.MoePath = "auto") -> torch.Tensor:
    """`fused_moe` with a config override, an output buffer and a path (auto|gemv|tiled, see
    moe_decode.select_path: decode batches may take moe_decode's GEMVs) for tests, benches, the tuner."""
    _check_moe_args(hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, swiglu_limit)
    if out is None:
        out = torch.empty_like(hidden)
    num_tokens, hidden_size = hidden.shape
    num_experts, inter, top_k = w13.shape[0], w13.shape[1] // 2, topk_ids.shape[1]
    if num_tokens == 0:
        return out
    if moe_decode.select_path(num_tokens, top_k, config, path) == "gemv":
        return moe_decode.fused_moe_gemv(hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias,
                                         swiglu_limit, out)
    cfg = config or get_moe_config(num_experts, hidden_size, inter, top_k, hidden.dtype, num_tokens, hidden.device)
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, cfg.block_m, num_experts)
    act = hidden.new_empty((sorted_ids.shape[0], inter))
    moe_gemm1(hidden, w13, w13_bias, sorted_ids, expert_ids, num_post, top_k, cfg.block_m, cfg.gemm1, act, activation,
              swiglu_limit)
    partial = hidden.new_empty((num_tokens * top_k, hidden_size))
    moe_gemm2(act, w2, w2_bias, topk_weights, sorted_ids, expert_ids, num_post, cfg.block_m, cfg.gemm2, partial)
    return moe_sum(partial, topk_ids, num_experts, out)


# Opaque to torch.compile: Inductor sees one node with a fake (shape-only) implementation
# instead of tracing into the Triton launches. Eager calls skip the dispatcher (its per-call host cost).
@torch.library.custom_op("atom::fused_moe", mutates_args=())
def fused_moe_op(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, activation: str = "silu", w13_bias: Optional[torch.Tensor] = None,
                 w2_bias: Optional[torch.Tensor] = None, swiglu_limit: Optional[float] = None) -> torch.Tensor:
    return launch_fused_moe(hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, swiglu_limit)


@fused_moe_op.register_fake
def _(hidden, w13, w2, topk_weights, topk_ids, activation="silu", w13_bias=None, w2_bias=None, swiglu_limit=None):
    _check_moe_args(hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, swiglu_limit)
    return torch.empty_like(hidden)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu", w13_bias: Optional[torch.Tensor] = None,
              w2_bias: Optional[torch.Tensor] = None, swiglu_limit: Optional[float] = None) -> torch.Tensor:
    """Same contract as `moe_ref.fused_moe`; four or five launches (see the module docstring).
    Precision: float32 accumulation in both GEMMs, the activation in float32 rounded once to
    hidden's dtype, each weighted expert output rounded once, their sum in float32."""
    if torch.compiler.is_compiling():
        return fused_moe_op(hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, swiglu_limit)
    return launch_fused_moe(hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, swiglu_limit)

