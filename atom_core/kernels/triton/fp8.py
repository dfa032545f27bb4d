"""FP8 activation quantization (Triton) and the e4m3 dot every FP8 GEMM shares (moe_fp8.py, fp8_gemm.py).

The quantizer is one launch per call instead of the reference's chain of elementwise kernels.
Same contract and bits as `kernels.fp8_ref.quantize_fp8_per_token` / `quantize_fp8_per_token_group`:
scale = max(absmax / 448, MIN_SCALE) in float32, x / scale (IEEE division) clamped to +-448 and
cast to e4m3 (round to nearest even).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_core.kernels import fp8_ref
from atom_core.kernels.fp8_ref import FP8_DTYPE, MIN_SCALE
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
    assert x.dim() == 2 and x.stride(-1) == 1, "x must be [M, K] with unit-stride rows"
    m, k = x.shape
    groups = triton.cdiv(k, group_size)
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m:
        _quant_fp8_group_kernel[(m, groups)](x, q, s, k, group_size, x.stride(0), q.stride(0), s.stride(0),
                                             MIN_SCALE, BLOCK=next_pow2(group_size))
    return q, s


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scale [M, 1]): one group per row."""
    return quantize_fp8_per_token_group(x, x.shape[1])


@triton.jit
def dot_fp8(a, b, DOT_MODE: tl.constexpr):
    """a [M, K] e4m3 x b [K, N] e4m3 -> float32. DOT_MODE 0: native fp8 MMA; 1: widened to
    bfloat16 (exact); 2: widened to float32, IEEE (the interpreter)."""
    if DOT_MODE == 0:
        return tl.dot(a, b)
    elif DOT_MODE == 1:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


INTERPRETED = not isinstance(_quant_fp8_group_kernel, triton.runtime.jit.JITFunction)


def quantize_activations(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 [M, ceil(K/G)]). Triton's CPU interpreter casts float32 to
    e4m3 wrongly (see tests/quant/test_fp8_ops.py), so under it the torch reference quantizes (the
    same bits the Triton quantizer gives on a GPU); the GEMMs are what the interpreter tests check."""
    if INTERPRETED:
        return fp8_ref.quantize_fp8_per_token_group(x, group_size)
    return quantize_fp8_per_token_group(x, group_size)


def dot_mode(device: torch.device) -> int:
    """dot_fp8's mode: 2 under the interpreter, 0 (native e4m3 MMA) on NVIDIA SM89+, else 1."""
    if INTERPRETED:
        return 2
    if torch.version.hip is None and torch.cuda.get_device_capability(device) >= (8, 9):
        return 0
    return 1
