"""SiLU-and-multiply for gated MLPs (Triton)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_core.kernels.triton.common import check_float, check_last_dim_contiguous

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    # Round silu(gate) to the input dtype before the product, as the eager reference does.
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2*I] -> silu(x[..., :I]) * x[..., I:] as a new contiguous tensor."""
    check_float("x", x)
    check_last_dim_contiguous("x", x)
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dim, got shape {tuple(x.shape)}")
    inter = x.shape[-1] // 2
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    num_rows = x2.shape[0]
    if num_rows == 0 or inter == 0:
        return out
    grid = (num_rows, triton.cdiv(inter, BLOCK))
    _silu_and_mul_kernel[grid](x2, out, x2.stride(0), inter, inter, BLOCK=BLOCK, num_warps=4)
    return out
