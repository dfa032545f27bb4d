"""RMSNorm and fused residual-add + RMSNorm (Triton).

Rounding follows the eager reference step by step (normalise in fp32, round to x.dtype, then
multiply by the weight), so bf16 results match it to the last bit in most elements.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_core.kernels.triton.common import check_float, check_last_dim_contiguous, next_pow2

# Rows per program: aim for ~4K elements a program, so small hidden sizes (per-head q/k norm,
# D = 128) don't launch one tiny program per row.
TARGET_TILE_ELEMS = 4096


@triton.jit
def normalize(x, w_ptr, cols, col_ok, n_cols, eps, X_DTYPE: tl.constexpr):
    """x: fp32 [BLOCK_R, BLOCK_N] -> fp32 weight * round_to_x_dtype(x / rms(x))."""
    rstd = tl.math.rsqrt(tl.sum(x * x, 1) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    return (x * rstd[:, None]).to(X_DTYPE).to(tl.float32) * w[None, :]


@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, num_rows, n_inner, stride_x0, stride_x1, n_cols, eps,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Row r of the logical [n_outer * n_inner, n_cols] view lives at (r // n_inner, r % n_inner)
    # of x, so strided 3-D views (q heads inside a fused qkv buffer) need no copy.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < num_rows, cols < n_cols
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    x_off = (rows64 // n_inner) * stride_x0 + (rows64 % n_inner) * stride_x1
    x = tl.load(x_ptr + x_off[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = normalize(x, w_ptr, cols, col_ok, n_cols, eps, x_ptr.dtype.element_ty)
    tl.store(out_ptr + rows64[:, None] * n_cols + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_rows"])
def _fused_add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, num_rows, n_cols, eps,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    mask = (rows < num_rows)[:, None] & col_ok[None, :]
    offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    # Every load happens before any store, so out/res_out may alias x/residual (in place).
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = (x + r).to(res_out_ptr.dtype.element_ty)
    y = normalize(s.to(tl.float32), w_ptr, cols, col_ok, n_cols, eps, x_ptr.dtype.element_ty)
    tl.store(res_out_ptr + offs, s, mask=mask)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch_shape(num_rows: int, n_cols: int) -> tuple[int, int, int, int]:
    block_n = next_pow2(n_cols)
    block_r = max(1, min(TARGET_TILE_ELEMS // block_n, next_pow2(num_rows)))
    num_warps = min(16, max(1, block_r * block_n // 512))
    return block_r, block_n, triton.cdiv(num_rows, block_r), num_warps


def _check_weight(x: torch.Tensor, weight: torch.Tensor) -> None:
    check_float("x", x)
    check_float("weight", weight)
    if weight.dim() != 1 or x.dim() == 0 or x.shape[-1] != weight.shape[0] or weight.stride(0) != 1:
        raise ValueError(f"weight {tuple(weight.shape)} must be a contiguous [N] for x {tuple(x.shape)}")
    check_last_dim_contiguous("x", x)
    if x.device != weight.device:
        raise ValueError(f"x on {x.device} but weight on {weight.device}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / rms(x) * weight over the last dim; returns a new contiguous tensor.

    Output dtype is promote(x.dtype, weight.dtype), as in the reference.
    """
    _check_weight(x, weight)
    n_cols = x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if x.dim() == 1:
        x = x.unsqueeze(0)
    if x.dim() > 3:
        x = x.reshape(-1, n_cols)
    if x.dim() == 2:  # [R, N] seen as [R, 1, N]
        n_inner, stride_x0, stride_x1 = 1, x.stride(0), 0
    else:
        n_inner, stride_x0, stride_x1 = x.shape[1], x.stride(0), x.stride(1)
    num_rows = x.numel() // n_cols if n_cols else 0
    if num_rows == 0:
        return out
    block_r, block_n, grid, num_warps = _launch_shape(num_rows, n_cols)
    _rms_norm_kernel[(grid,)](
        x, weight, out, num_rows, n_inner, stride_x0, stride_x1, n_cols, eps,
        BLOCK_R=block_r, BLOCK_N=block_n, num_warps=num_warps,
    )
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual (in x.dtype); returns (rms_norm(residual'), residual').

    IN PLACE: residual' is written into `residual`, and the normed output into `x` when
    promote(x.dtype, weight.dtype) == x.dtype (else into a new tensor). Callers must not use
    the inputs afterwards: `hidden, residual = fused_add_rms_norm(hidden, residual, w, eps)`.
    """
    _check_weight(x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x "
                         f"{tuple(x.shape)} {x.dtype}")
    if not (x.is_contiguous() and residual.is_contiguous()):
        raise ValueError("fused_add_rms_norm writes in place and needs contiguous x and residual")
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    out = x if out_dtype == x.dtype else torch.empty(x.shape, dtype=out_dtype, device=x.device)
    n_cols = x.shape[-1]
    num_rows = x.numel() // n_cols if n_cols else 0
    if num_rows == 0:
        return out, residual
    block_r, block_n, grid, num_warps = _launch_shape(num_rows, n_cols)
    _fused_add_rms_norm_kernel[(grid,)](
        x, residual, weight, out, residual, num_rows, n_cols, eps,
        BLOCK_R=block_r, BLOCK_N=block_n, num_warps=num_warps,
    )
    return out, residual


@triton.jit(do_not_specialize=["num_rows"])
def _gated_rms_norm_kernel(
    x_ptr, z_ptr, w_ptr, out_ptr, num_rows, stride_x, stride_z, n_cols, eps,
    ROUND_PRODUCT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    mask = (rows < num_rows)[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + rows64[:, None] * stride_z + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = normalize(x, w_ptr, cols, col_ok, n_cols, eps, x_ptr.dtype.element_ty)
    if ROUND_PRODUCT:  # HF rounds weight * normed to promote(weight, x) = x's dtype before the fp32 gate
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    y = y * (z * tl.sigmoid(z))
    tl.store(out_ptr + rows64[:, None] * n_cols + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Qwen3NextRMSNormGated: (weight * rms_normalise(x)) * silu(z), a new tensor in x's dtype.
    x, z [..., D] with rows reachable by one stride each (a view into a wider projection is fine)."""
    _check_weight(x, weight)
    check_float("z", z)
    if z.shape != x.shape:
        raise ValueError(f"z {tuple(z.shape)} must match x {tuple(x.shape)}")
    n_cols = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x2, z2 = x.reshape(-1, n_cols), z.reshape(-1, n_cols)
    check_last_dim_contiguous("z", z2)
    num_rows = x2.shape[0]
    if num_rows == 0:
        return out
    block_r, block_n, grid, num_warps = _launch_shape(num_rows, n_cols)
    _gated_rms_norm_kernel[(grid,)](
        x2, z2, weight, out, num_rows, x2.stride(0), z2.stride(0), n_cols, eps,
        ROUND_PRODUCT=torch.promote_types(x.dtype, weight.dtype) == x.dtype,
        BLOCK_R=block_r, BLOCK_N=block_n, num_warps=num_warps,
    )
    return out
