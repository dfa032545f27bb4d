"""INT8 (W8A8) and INT4 (W4A16) products: the torch references (the CPU path, and every GPU
kernel test's oracle) and the device dispatch to the Triton kernels of the same signatures.

Canonical INT4 layout (what every int4 format is repacked into after loading, and what the
kernels read), for a weight W [N, K] split into groups of `group_size` columns:
  qweight int32 [N, K/8]: element k of row n is nibble k % 8 (bits 4*(k%8)) of word k // 8,
                          an unsigned value u in [0, 15];
  scales  [N, K/group_size] in the activation dtype;
  zeros   uint8 [N, K/group_size] unsigned zero points, or None for symmetric weights (zero 8).
  W[n, k] = (u[n, k] - zero[n, k // group_size]) * scale[n, k // group_size]
The int4 linear methods store qweight in the kernel layout (`interleave_int4`, INT4_INTERLEAVE
words a chunk) where K allows: the same words with their nibbles reordered inside each chunk, so
the GEMV meets contiguous activations per nibble (kernels/triton/w4a16.py). `interleave` = 1 names
the canonical layout everywhere below.

INT8 W8A8: weight int8 [N, K] with a float32 scale per output channel; activations quantized
on the fly per token, symmetric, by compressed-tensors' rule (scale = absmax / 127.5, values
rounded half to even and clamped to [-128, 127]), accumulated exactly in int32.
"""
from __future__ import annotations

from typing import Optional

import torch

from atom_core.kernels.int4_layout import INT4_INTERLEAVE, INT4_PER_INT32, check_interleave
from atom_core.kernels.torch_ref import ieee_div

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble i sits at bits 4i


# ---------------------------------------------------------------------------------------------
# int4 packing (host side, load time)


def unpack_int4(packed: torch.Tensor, dim: int, size: int | None = None, order: list[int] | None = None) -> torch.Tensor:
    """int32 words packed along `dim` (nibble i = bits 4i) -> uint8 values in [0, 15], `dim`
    grown 8x (then cut to `size`). `order[i]` is the position inside the word's 8 values that
    nibble i holds (AWQ's interleaved order); None: nibble i holds value i."""
    packed = packed.to(torch.int32).movedim(dim, -1)
    values = (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 0xF  # [..., words, 8 nibbles]
    if order is not None:
        values = values[..., torch.tensor(order).argsort()]  # nibble order -> value order
    values = values.flatten(-2)
    if size is not None:
        values = values[..., :size]
    return values.to(torch.uint8).movedim(-1, dim).contiguous()


def pack_int4(values: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """uint8/int values in [0, 15] -> int32 words packed along `dim` (value i of a word at bits 4i);
    `dim` is padded with zeros to a multiple of 8."""
    v = values.to(torch.int32).movedim(dim, -1)
    pad = -v.shape[-1] % INT4_PER_INT32
    if pad:
        v = torch.nn.functional.pad(v, (0, pad))
    v = v.unflatten(-1, (-1, INT4_PER_INT32)) << _SHIFTS.to(v.device)
    return v.sum(-1, dtype=torch.int32).movedim(-1, dim).contiguous()  # disjoint bits: sum == or


def interleave_for(k: int) -> int:
    """The layout the int4 linears store for input size K: the kernel layout where whole chunks
    tile K (K a multiple of 8 * INT4_INTERLEAVE), else the canonical one."""
    return INT4_INTERLEAVE if k % (INT4_PER_INT32 * INT4_INTERLEAVE) == 0 else 1


def _swap_chunk_axes(qweight: torch.Tensor, interleave: int, inner: tuple[int, int]) -> torch.Tensor:
    """Unpack, view each chunk of `interleave` words as `inner`, transpose it and repack."""
    n, words = qweight.shape
    check_interleave(interleave, words * INT4_PER_INT32)
    if interleave == 1:
        return qweight
    u = unpack_int4(qweight, 1).view(n, -1, *inner)
    return pack_int4(u.transpose(-1, -2).reshape(n, -1), 1)


def interleave_int4(qweight: torch.Tensor, interleave: int = INT4_INTERLEAVE) -> torch.Tensor:
    """Canonical qweight [N, K/8] -> the kernel layout: inside each chunk of `interleave` words
    (8 * interleave columns), nibble j of word i holds column j * interleave + i."""
    return _swap_chunk_axes(qweight, interleave, (INT4_PER_INT32, interleave))  # [j, i] -> word i's nibble j


def deinterleave_int4(qweight: torch.Tensor, interleave: int) -> torch.Tensor:
    """The inverse of `interleave_int4`: back to the canonical layout."""
    return _swap_chunk_axes(qweight, interleave, (interleave, INT4_PER_INT32))


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    group_size: int, interleave: int = 1) -> torch.Tensor:
    """qweight (canonical, or the kernel layout with `interleave` > 1) -> W [N, K] in the scales' dtype."""
    num_groups = scales.shape[1]
    u = unpack_int4(deinterleave_int4(qweight, interleave), 1, num_groups * group_size).to(scales.dtype)
    z = 8 if zeros is None else zeros.to(scales.dtype).repeat_interleave(group_size, 1)
    return (u - z) * scales.repeat_interleave(group_size, 1)


# ---------------------------------------------------------------------------------------------
# torch references


def w4a16_gemm_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                   group_size: int, bias: torch.Tensor | None = None, interleave: int = 1) -> torch.Tensor:
    """y [*, N] = x [*, K] @ W^T (+ bias), W the int4 weight (layout per `interleave`) dequantized to x's dtype."""
    w = dequantize_int4(qweight, scales.to(x.dtype), zeros, group_size, interleave)
    return torch.nn.functional.linear(x, w, bias)


def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], float32 scale [M, 1]), symmetric per row (compressed-tensors' rule)."""
    xf = x.float()
    scale = ieee_div(xf.abs().amax(dim=-1, keepdim=True), 127.5)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # an all-zero row stays zero
    q = torch.clamp(torch.round(xf / scale), -128, 127).to(torch.int8)
    return q, scale


def int8_mm_int32(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """a int8 [M, K] @ b_t int8 [N, K]^T -> int32 [M, N], exact."""
    try:
        return torch._int_mm(a, b_t.t())
    except RuntimeError:  # shapes this build's _int_mm does not take: float64 is exact for K < 2**38
        return (a.double() @ b_t.double().t()).to(torch.int32)


def int8_w8a8_gemm_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [*, N] = quant(x) [*, K] @ weight int8 [N, K]^T * x_scale * weight_scale [N, 1]^T (+ bias), in x's dtype."""
    shape = x.shape
    q, x_scale = quantize_per_token_int8(x.reshape(-1, shape[-1]))
    acc = int8_mm_int32(q, weight)
    y = acc.float() * x_scale * weight_scale.float().reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*shape[:-1], weight.shape[0])


# ---------------------------------------------------------------------------------------------
# device dispatch: Triton on CUDA/ROCm, the references elsewhere. Custom ops, so a compiled
# model sees one opaque node (the Triton wrappers' host checks and autotuning are not traceable).


@torch.library.custom_op("atom::w4a16_gemm", mutates_args=())
def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
               group_size: int, bias: Optional[torch.Tensor] = None, interleave: int = 1) -> torch.Tensor:
    if x.device.type == "cuda":
        from atom_core.kernels.triton.w4a16 import w4a16_gemm as kernel

        return kernel(x, qweight, scales, zeros, group_size, bias, interleave=interleave)
    return w4a16_gemm_ref(x, qweight, scales, zeros, group_size, bias, interleave)


@w4a16_gemm.register_fake
def _(x, qweight, scales, zeros, group_size, bias=None, interleave=1):
    return x.new_empty(*x.shape[:-1], qweight.shape[0])


@torch.library.custom_op("atom::int8_w8a8_gemm", mutates_args=())
def int8_w8a8_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    if x.device.type == "cuda":
        from atom_core.kernels.triton.int8 import int8_w8a8_gemm as kernel

        return kernel(x, weight, weight_scale, bias)
    return int8_w8a8_gemm_ref(x, weight, weight_scale, bias)


@int8_w8a8_gemm.register_fake
def _(x, weight, weight_scale, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])
