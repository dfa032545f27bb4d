"""Dense FP8 GEMMs (Triton): y [M, N] = x [M, K] @ W^T with W e4m3 [N, K], for the two scale layouts
of `quant/fp8_ops.py` (same signatures and contracts as its references):

  fp8_block_gemm(x, weight, weight_scale_inv, block_size, bias)      ~ fp8_block_linear_ref
      block FP8 (DeepSeek-V3/R1, Qwen3-*-FP8): scales [ceil(N/bn), ceil(K/bk)]; the loader passes
      them row-expanded (bn = 1, one row per weight row: TP slices and fused shards unchanged);
      activations quantized per token per bk columns.
  fp8_channel_gemm(x, weight, weight_scale, input_scale, bias)       ~ fp8_linear_ref
      per-channel ([N] / [N, 1]) or per-tensor weight scales; activations dynamic per token, or
      static per tensor when `input_scale` is given.

One kernel (`_fp8_gemm_kernel`) runs both. Per K step of BLOCK_K columns: one e4m3 x e4m3 dot
into float32 (kernels/triton/fp8.py's `dot_fp8`: native e4m3 MMA on SM89+, widened elsewhere), then
  block:        acc += dot * x_scale[row, group] * w_scale[col, group]   (BLOCK_K divides bk, so a
                step lies in one scale group; Hopper's FP8 MMA accumulates with fewer bits than
                float32, and this per-group promotion bounds that to one group, as in moe_fp8)
  per-channel:  acc += dot, both scales in the epilogue.
Split-K (grid axis 1): each split owns a run of whole K steps and writes float32 partials
[SPLIT_K, M, N]; `_sum_splits_kernel` adds them (fixed order: deterministic), the bias, and
rounds once to x's dtype. Without a split the GEMM stores the result itself.

Activation quantization (the references' bits: scale = max(absmax / 448, MIN_SCALE), x / scale
in IEEE division, clamped to +-448, rounded to nearest even):
  * fused (small M, `Fp8GemmConfig.fused_quant`): the GEMM reads x itself. Block: a step is one
    scale group (BLOCK_K == bk), so its absmax is the tile's. Per token: a prologue walks the
    row's whole K for the absmax (M <= 16 rows from L2: a few % of the weight bytes), so every
    split sees the same scale. This saves the quantizer launch, a large share of a small GEMM.
  * separate (larger M, where re-quantizing x per N tile would cost more than a launch): the
    Triton quantizer (`kernels/triton/fp8.py`) first, or the torch per-tensor quantizer for a
    static scale.
Under Triton's CPU interpreter, float32 -> e4m3 casts are wrong (tests/quant/test_fp8_ops.py), so
there the fused path rounds to the e4m3 grid arithmetically first (then the cast is exact) and
the separate path uses the torch quantizer (kernels/triton/fp8.py's `quantize_activations`).

Tiles (`default_fp8_gemm_config`): M <= 16 (decode, a weight stream: each weight byte read once)
uses BLOCK_M 16 (the MMA's minimum) with split-K until about 2 programs per SM; larger M uses
wider tiles without split. Untuned (chosen from offline sm_90 compiles without spills,
tests/quant/test_fp8_gemm.py); at 1 token the weight-only GEMV (fp8_gemv.py) is the faster path
and the default there (measured: see docs/PERFORMANCE.md). Offline sm_90 code: BLOCK_M 16-32
tiles run mma.sync on e4m3 widened to f16 (exact), 64+ use e4m3 wgmma; weight tiles stream by
16-byte cp.async. Levers if the bench shows M = 1 far from the floor: the fused quantizer divides
a BLOCK_M 16 tile (15 padded copies of the row at M = 1) per step, and the per-token prologue
re-reads the row per program (L2); wider BLOCK_N or a multiply by 1/scale (bits may then differ
from the reference by one e4m3 step on rare elements) cut that work.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from atom_core.kernels.fp8_ref import FP8_DTYPE, MIN_SCALE, SMALL_M_MAX, quantize_fp8_per_tensor
from atom_core.kernels.triton.common import check_dim, check_float, check_same_device, sm_count
from atom_core.kernels.triton.fp8 import dot_fp8, dot_mode, quantize_activations
from atom_core.kernels.triton.tiles import load_a_tile, load_w_tile, tile_ids

QUANT_NONE, QUANT_DYNAMIC, QUANT_STATIC = 0, 1, 2  # how x reaches the kernel (QUANT below)
PROGRAMS_PER_SM = 2  # split-K aims for this many programs per SM at small M
MAX_SPLIT_K = 16


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int
    block_n: int
    block_k: int  # divides the scale group (block FP8); the fused block quantizer needs it equal
    split_k: int  # K splits (grid axis 1); 1 = the GEMM stores the output itself
    group_m: int  # m blocks that sweep the n tiles together (L2 reuse of weight tiles)
    num_warps: int
    num_stages: int
    fused_quant: bool  # the GEMM quantizes x itself (module docstring)


@triton.jit
def _round_to_e4m3_grid(v):
    """float32 v (|v| <= 448) -> the nearest e4m3 value (ties to even), in float32: the grid step
    is 2^(e-3) for |v| >= 2^-6 (e = v's exponent), 2^-9 below (subnormals). Only under the
    interpreter, whose float32 -> e4m3 cast is wrong; adding and removing 1.5 * 2^23 rounds the
    (at most 16) steps to an integer in float32, half to even."""
    exp = (v.to(tl.int32, bitcast=True) >> 23) & 0xFF
    step = (tl.maximum(exp - 3, 118) << 23).to(tl.float32, bitcast=True)
    return ((v / step + 12582912.0) - 12582912.0) * step


@triton.jit
def _quantize_tile(xf, scale, DOT_MODE: tl.constexpr):
    """float32 [BM, BK] / scale [BM, 1] -> e4m3, the reference's bits (clamp, round to nearest even)."""
    v = tl.div_rn(xf, tl.zeros_like(xf) + scale)
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    if DOT_MODE == 2:
        v = _round_to_e4m3_grid(v)
    return v.to(tl.float8e4nv)


@triton.jit
def _row_scale(x_ptrs, K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, min_scale):
    """Per-token dynamic scale of the tile's rows: max(absmax over all K / 448, min_scale), [BLOCK_M, 1]."""
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        xt = load_a_tile(x_ptrs, k0, K, BLOCK_K, K % BLOCK_K != 0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(xt), axis=1))
        x_ptrs += BLOCK_K
    return tl.maximum(tl.div_rn(amax, tl.zeros_like(amax) + 448.0), min_scale)[:, None]


@triton.jit(do_not_specialize=["M", "steps_per_split"])
def _fp8_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr,
    M, steps_per_split, min_scale, stride_xm, stride_xsm, stride_xsk, stride_wn, stride_wsn, stride_wsk,
    stride_om, stride_os,
    N: tl.constexpr, K: tl.constexpr, GROUP: tl.constexpr, SCALE_BN: tl.constexpr, PER_GROUP: tl.constexpr,
    QUANT: tl.constexpr, HAS_BIAS: tl.constexpr, IS_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_MODE: tl.constexpr,
):
    """One BLOCK_M x BLOCK_N output tile over one split's K steps.
    x: e4m3 (QUANT 0) or the activation dtype (1: dynamic scales computed here, 2: static scale
    read from xs). x scales [M, groups] (block) / [M, 1] (per token) / stride 0 (per tensor); w
    scales row r at ws_ptr + (r // SCALE_BN) * stride_wsn (+ group * stride_wsk when PER_GROUP)."""
    pid_m, pid_n = tile_ids(tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    split = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    # rows past M and columns past N read real rows (no masks in the loop); they are never stored
    rows_in = tl.minimum(rows, M - 1).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_in = tl.minimum(cols, N - 1)
    offs_k = tl.arange(0, BLOCK_K)
    MASK_K: tl.constexpr = K % BLOCK_K != 0
    x_row_ptrs = x_ptr + rows_in[:, None] * stride_xm + offs_k[None, :]
    xs_ptrs = xs_ptr + rows_in * stride_xsm
    ws_ptrs = ws_ptr + (cols_in // SCALE_BN).to(tl.int64) * stride_wsn
    if QUANT == 1 and not PER_GROUP:
        x_scale = _row_scale(x_row_ptrs, K, BLOCK_K, BLOCK_M, min_scale)
    elif QUANT == 2:
        x_scale = tl.load(xs_ptr)  # static, per tensor
    first = split * steps_per_split
    num_steps = tl.minimum(steps_per_split, tl.cdiv(K, BLOCK_K) - first)
    k_start = first * BLOCK_K
    x_ptrs = x_row_ptrs + k_start
    w_ptrs = w_ptr + cols_in.to(tl.int64)[None, :] * stride_wn + (k_start + offs_k)[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for i in range(0, num_steps):
        k0 = k_start + i * BLOCK_K
        w = load_w_tile(w_ptrs, k0, K, BLOCK_K, MASK_K)
        if QUANT == 0:
            a = load_a_tile(x_ptrs, k0, K, BLOCK_K, MASK_K)
        else:
            xf = load_a_tile(x_ptrs, k0, K, BLOCK_K, MASK_K).to(tl.float32)
            if QUANT == 1 and PER_GROUP:  # the step is the whole scale group (BLOCK_K == GROUP)
                x_scale = tl.maximum(tl.div_rn(tl.max(tl.abs(xf), axis=1), tl.zeros([BLOCK_M], tl.float32) + 448.0),
                                     min_scale)[:, None]
            a = _quantize_tile(xf, x_scale, DOT_MODE)
        if PER_GROUP:
            grp = k0 // GROUP
            if QUANT == 0:
                x_scale = tl.load(xs_ptrs + grp * stride_xsk)[:, None]
            acc += dot_fp8(a, w, DOT_MODE) * (x_scale * tl.load(ws_ptrs + grp * stride_wsk)[None, :])
        else:
            acc += dot_fp8(a, w, DOT_MODE)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if not PER_GROUP:
        if QUANT == 0:
            x_scale = tl.load(xs_ptrs)[:, None]
        acc *= x_scale * tl.load(ws_ptrs)[None, :]
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    if IS_SPLIT:
        out_ptrs = out_ptr + split * stride_os + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
        tl.store(out_ptrs, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols_in)[None, :].to(tl.float32)
        out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_splits_kernel(part_ptr, bias_ptr, out_ptr, N, stride_ps, stride_pm, stride_om,
                       SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """out[m, cols] = sum over splits (in order) of the float32 partials (+ bias), rounded once."""
    m = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(part_ptr + s * stride_ps + m * stride_pm + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# host side


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap that divides n."""
    return min(n & -n, cap)


def default_fp8_gemm_config(m: int, n: int, k: int, group: int | None, num_sms: int) -> Fp8GemmConfig:
    """Tiles by M; `group` is the block-FP8 scale group (bk), None for per-channel scales. Untuned
    (no GPU when written): M <= 16 is one BLOCK_M 16 tile row streaming the weight, split over K
    until ~2 programs per SM; larger M uses the moe_fp8 tiers' shapes (no spills at sm_90)."""
    bk = 128 if group is None else _pow2_divisor(group, 128)
    if m <= SMALL_M_MAX:  # one BLOCK_M 16 tile row (the MMA's minimum): each weight byte read once
        bm, bn, gm, warps, stages = 16, 64, 1, 4, 4
    elif m <= 64:
        bm, bn, gm, warps, stages = 32, 64, 1, 4, 4
    elif m <= 256:
        bm, bn, gm, warps, stages = 64, 128, 8, 4, 3
    else:
        bm, bn, gm, warps, stages = 128, 128, 8, 8, 3
    fused = m <= SMALL_M_MAX and (group is None or bk == group)
    tiles = max(1, triton.cdiv(m, bm) * triton.cdiv(n, bn))
    steps = triton.cdiv(k, bk)
    split = 1
    if tiles < num_sms:
        split = max(1, min(steps, MAX_SPLIT_K, triton.cdiv(PROGRAMS_PER_SM * num_sms, tiles)))
        even = [d for d in range(split, (split + 1) // 2 - 1, -1) if steps % d == 0]
        split = even[0] if even else triton.cdiv(steps, triton.cdiv(steps, split))  # equal runs, none empty
    return Fp8GemmConfig(bm, bn, bk, split, gm, warps, stages, fused)


def check_operands(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    """x [M, K] float, weight e4m3 [N, K] with unit-stride rows, float32 scales, bias [N]: every dense FP8 kernel's operands."""
    check_dim("weight", weight, 2)
    check_float("x", x2)
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"weight must be float8_e4m3fn, got {weight.dtype}")
    if x2.shape[1] != weight.shape[1]:
        raise ValueError(f"x has {x2.shape[1]} columns but weight is {tuple(weight.shape)} ([N, K])")
    if weight.stride(1) != 1 or (x2.shape[1] > 1 and x2.stride(1) != 1):
        raise ValueError(f"x and weight need contiguous rows, got strides {x2.stride()} and {weight.stride()}")
    if scale.dtype != torch.float32:
        raise ValueError(f"weight scales must be float32, got {scale.dtype}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    check_same_device(x=x2, weight=weight, scale=scale, **({} if bias is None else {"bias": bias}))


def _launch(x2, xs, stride_xs, weight, w_scale, stride_ws, scale_bn, group, per_group, quant, bias, out_dtype,
            cfg: Fp8GemmConfig) -> torch.Tensor:
    """Runs the GEMM (and the split sum) on prepared operands; returns [M, N] in out_dtype."""
    m, k = x2.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=x2.device)
    if m == 0:
        return out
    per_split, split, target = split_k_target(out, k, cfg.block_k, cfg.split_k)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), split)
    _fp8_gemm_kernel[grid](
        x2, xs, weight, w_scale, bias if bias is not None else w_scale, target,
        m, per_split, MIN_SCALE, x2.stride(0), *stride_xs, weight.stride(0), *stride_ws,
        target.stride(-2), target.stride(0) if split > 1 else 0,
        N=n, K=k, GROUP=group, SCALE_BN=scale_bn, PER_GROUP=per_group, QUANT=quant,
        HAS_BIAS=bias is not None, IS_SPLIT=split > 1, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, DOT_MODE=dot_mode(x2.device),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split > 1:
        sum_splits(target, bias, out)
    return out


def split_k_target(out: torch.Tensor, k: int, block_k: int, split_k: int) -> tuple[int, int, torch.Tensor]:
    """(K steps per split, splits, where the kernel writes): `out` itself without a split, else
    float32 partials [splits, M, N] for `sum_splits` (each split owns a run of whole K steps)."""
    steps = triton.cdiv(k, block_k)
    per_split = triton.cdiv(steps, split_k)
    split = triton.cdiv(steps, per_split)
    if split == 1:
        return per_split, split, out
    return per_split, split, torch.empty(split, *out.shape, dtype=torch.float32, device=out.device)


def sum_splits(partials: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out = sum of the float32 partials over splits (fixed order: deterministic) + bias, rounded once."""
    m, n = out.shape
    block = min(1024, triton.next_power_of_2(n))
    _sum_splits_kernel[(m, triton.cdiv(n, block))](
        partials, bias if bias is not None else partials, out, n, partials.stride(0), partials.stride(1),
        out.stride(0), SPLIT_K=partials.shape[0], HAS_BIAS=bias is not None, BLOCK=block)


def block_gemm_supported(block_size: list[int] | tuple[int, int]) -> bool:
    """Whether the kernel runs this block layout: a K step (a power of two >= 16, the MMA's K)
    must divide the scale group bk."""
    return len(block_size) == 2 and block_size[0] >= 1 and _pow2_divisor(int(block_size[1]), 128) >= 16


def _check_tile(cfg: Fp8GemmConfig, group: int | None) -> None:
    if cfg.block_k < 16 or (group is not None and group % cfg.block_k):
        raise ValueError(f"FP8 GEMM tiles need block_k >= 16{'' if group is None else f' dividing the group {group}'}"
                         f", got {cfg.block_k}")
    if cfg.fused_quant and group is not None and cfg.block_k != group:
        raise ValueError(f"the fused block quantizer needs block_k == the scale group {group}, got {cfg.block_k}")


def fp8_block_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, block_size: list[int],
                   bias: Optional[torch.Tensor] = None, *, config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """Same contract as `quant.fp8_ops.fp8_block_linear_ref`: x [*, K] (bf16/fp16/fp32), weight e4m3
    [N, K], weight_scale_inv float32 [ceil(N/bn), ceil(K/bk)] (bn = 1: row-expanded, as loaded) ->
    [*, N] in x's dtype. Precision: e4m3 products exact, summed in float32 per scale group, times
    both scales, added in float32 (split partials summed in a fixed order), rounded once."""
    bn, bk = (int(b) for b in block_size)
    shape, (n, k) = x.shape, weight.shape
    x2 = x.reshape(-1, shape[-1])
    check_operands(x2, weight, weight_scale_inv, bias)
    if not block_gemm_supported(block_size):
        raise ValueError(f"block-FP8 GEMM needs a K block with a power-of-two divisor >= 16, got {list(block_size)}")
    expect = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    if tuple(weight_scale_inv.shape) != expect:
        raise ValueError(f"weight_scale_inv must be {list(expect)} for weight {tuple(weight.shape)} and block "
                         f"{[bn, bk]}, got {tuple(weight_scale_inv.shape)}")
    cfg = config or default_fp8_gemm_config(x2.shape[0], n, k, bk, sm_count(x.device))
    _check_tile(cfg, bk)
    if cfg.fused_quant:
        xq, xs, stride_xs, quant = x2, weight_scale_inv, (0, 0), QUANT_DYNAMIC
    else:
        xq, xs = quantize_activations(x2, bk)
        stride_xs, quant = (xs.stride(0), xs.stride(1)), QUANT_NONE
    out = _launch(xq, xs, stride_xs, weight, weight_scale_inv, weight_scale_inv.stride(), bn, bk, True, quant, bias,
                  x.dtype, cfg)
    return out.reshape(*shape[:-1], n)


def channel_scales(weight_scale: torch.Tensor, n: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """Per-tensor or per-channel weight scales as a flat [1] / [N] tensor and the kernels' (row, group) strides."""
    w_scale = weight_scale.reshape(-1)
    if w_scale.numel() not in (1, n):
        raise ValueError(f"weight_scale must hold 1 or N={n} values, got {tuple(weight_scale.shape)}")
    return w_scale, (0 if w_scale.numel() == 1 else w_scale.stride(0), 0)


def fp8_channel_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     input_scale: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None, *,
                     config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """Same contract as `quant.fp8_ops.fp8_linear_ref`: weight_scale float32 with 1 or N values (per
    tensor / per channel); activations dynamic per token, or static per tensor (`input_scale`)."""
    shape, (n, k) = x.shape, weight.shape
    x2 = x.reshape(-1, shape[-1])
    check_operands(x2, weight, weight_scale, bias)
    w_scale, stride_ws = channel_scales(weight_scale, n)
    cfg = config or default_fp8_gemm_config(x2.shape[0], n, k, None, sm_count(x.device))
    _check_tile(cfg, None)
    if input_scale is not None:
        static = input_scale.float().reshape(1).to(x.device)
        if cfg.fused_quant:
            xq, xs, quant = x2, static, QUANT_STATIC
        else:
            (xq, xs), quant = quantize_fp8_per_tensor(x2, static), QUANT_NONE
        stride_xs = (0, 0)
    elif cfg.fused_quant:
        xq, xs, stride_xs, quant = x2, w_scale, (0, 0), QUANT_DYNAMIC
    else:
        xq, xs = quantize_activations(x2, k)  # one group per row: per token
        stride_xs, quant = (xs.stride(0), 0), QUANT_NONE
    out = _launch(xq, xs, stride_xs, weight, w_scale, stride_ws, 1, k, False, quant, bias, x.dtype, cfg)
    return out.reshape(*shape[:-1], n)
