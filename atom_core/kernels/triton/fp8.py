"""FP8 activation quantization (Triton): one launch per call instead of the reference's chain of
elementwise kernels. Same contract and bits as `quant.fp8_ops.quantize_fp8_per_token` /
`quantize_fp8_per_token_group`: scale = max(absmax / 448, MIN_SCALE) in float32, x / scale
(IEEE division) clamped to +-448 and cast to e4m3 (round to nearest even).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_core.kernels.triton.common import next_pow2


@triton.jit
def _quant_fp8_group_kernel(x_ptr, q_ptr, s_ptr, K, GROUP, stride_xm, stride_qm, stride_sm, min_scale,
                            BLOCK: tl.constexpr):
    row = tl.program_id(0)
    group = tl.program_id(1)
    offs = group * GROUP + tl.arange(0, BLOCK)
    mask = (tl.arange(0, BLOCK) < GROUP) & (offs < K)
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), axis=0), 448.0), min_scale)
    v = tl.div_rn(x, tl.zeros_like(x) + scale)
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    tl.store(q_ptr + row * stride_qm + offs, v.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + group, scale)


def quantize_fp8_per_token_group(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit-stride rows) -> (e4m3 [M, K], float32 scale [M, ceil(K / group_size)])."""
    from atom_core.quant.fp8_ops import _MIN_SCALE, FP8_DTYPE

    assert x.dim() == 2 and x.stride(-1) == 1, "x must be [M, K] with unit-stride rows"
    m, k = x.shape
    groups = triton.cdiv(k, group_size)
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m:
        _quant_fp8_group_kernel[(m, groups)](x, q, s, k, group_size, x.stride(0), q.stride(0), s.stride(0),
                                             _MIN_SCALE, BLOCK=next_pow2(group_size))
    return q, s


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scale [M, 1]): one group per row."""
    return quantize_fp8_per_token_group(x, x.shape[1])
