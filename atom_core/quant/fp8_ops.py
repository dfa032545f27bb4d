"""FP8 (e4m3) quantization and scaled products: the torch references (the CPU path, and the
oracle of every GPU kernel test) and the CUDA dispatch.

Conventions (every function below):
  fp8 dtype     torch.float8_e4m3fn, finite range [-448, 448] (FP8_MAX); values are scaled into
                that range, rounded to nearest (torch's cast) and clamped.
  scales        float32 *dequantization* multipliers: real = fp8.float() * scale. This is what
                checkpoints store as `weight_scale` (compressed-tensors, per-tensor/per-channel)
                and as `weight_scale_inv` (DeepSeek-V3 / Qwen3-FP8 block layout; despite the
                name it multiplies).
  block layout  weight fp8 [N, K] with weight_scale_inv float32 [ceil(N/bn), ceil(K/bk)]; block
                (i, j) covers rows i*bn .. min((i+1)*bn, N) and columns j*bk .. min((j+1)*bk, K)
                (the last block of a dimension that is not a multiple of the block is partial).

Activation quantization (dynamic, on the fly; these and the FP8 constants live in
kernels/fp8_ref.py, below the kernels that take them as oracles, and are re-exported here):
  quantize_fp8_per_tensor(x, scale=None) -> (q, scale [1])       static when `scale` is given
  quantize_fp8_per_token(x)              -> (q, scale [M, 1])    one scale per row
  quantize_fp8_per_token_group(x, g)     -> (q, scale [M, ceil(K/g)]) one scale per row and
                                            group of g columns (block-FP8 activations, g = bk)
Dequantization:
  dequantize_fp8_block(w, scale_inv, block) -> float32 [N, K]
Products (y [*, N] in x's dtype, x [*, K] in bf16/fp16/fp32):
  fp8_linear_ref(x, weight, weight_scale, input_scale=None, bias=None)
      weight fp8 [N, K], weight_scale float32 scalar/[1]/[N]/[N, 1] (per tensor or per channel);
      activations per-tensor static when `input_scale` is given, else dynamic per token.
  fp8_block_linear_ref(x, weight, weight_scale_inv, block_size, bias=None)
      block weights as above; activations quantized per token per `block_size[1]` columns.
  fp8_linear / fp8_block_linear: the same products as custom ops (`atom::fp8_linear`,
      `atom::fp8_block_linear`) that run the kernel of a per-M `KernelTable` (kernel_config.py). A
      layer makes its table once, from its weight's device, shape and activation dtype
      (`fp8_linear_table` / `fp8_block_linear_table`), and passes the table's key; a direct call
      without one (tests, benchmarks) makes the table for its arguments. Off NVIDIA SM89+ GPUs the
      tables hold the references (fp8_linear: torch._scaled_mm on a ROCm device where the shape
      allows it). On NVIDIA SM89+:
      - fp8_block_linear: the block GEMV (kernels/triton/fp8_gemv.py) at 1 token, where it beat the
        block GEMM; the Triton block-FP8 GEMM (kernels/triton/fp8_gemm.py) above, or the reference
        for blocks it does not support.
      - fp8_linear with dynamic activations: the weight-only FP8 GEMV (x not quantized, so closer to
        the bf16 product than these references) at 1 token; the weight-only GEMM
        (kernels/triton/fp8_w8a16.py) at 2-16 tokens, and at 17-32 for outputs of at most 8,192
        columns (wider ones stream more weight bytes than _scaled_mm's tiles save there); above,
        torch._scaled_mm (row-wise or per-tensor scales, activations quantized by one Triton launch,
        kernels/triton/fp8.py) where the shape allows it (K and N multiples of 16, bf16/fp16 x), else
        the Triton GEMM. A static input_scale is part of the checkpoint's arithmetic: those layers
        take _scaled_mm (or the Triton GEMM) at every M.

The references accumulate in float32 over the dequantized operands, which equals the sum over
K-blocks of the fp8 partial products times their scales up to float32 rounding.
"""
from __future__ import annotations

from typing import Optional

import torch

from atom_core.kernel_config import KernelTable
from atom_core.kernels.fp8_ref import (  # noqa: F401  (the quantizers are part of this module's API)
    FP8_DTYPE, FP8_MAX, GEMV_MAX_TOKENS, SMALL_M_MAX, dequantize_fp8_block, quantize_fp8_block,
    quantize_fp8_per_tensor, quantize_fp8_per_token, quantize_fp8_per_token_group,
)


# ---------------------------------------------------------------------------------------------
# torch references


def _finish(y: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor, shape, n: int) -> torch.Tensor:
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*shape[:-1], n)


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [*, N] = dequant(quant(x)) @ dequant(weight)^T (+ bias); per-tensor or per-channel weight scales."""
    shape, n = x.shape, weight.shape[0]
    x2 = x.reshape(-1, shape[-1])
    q, x_scale = quantize_fp8_per_token(x2) if input_scale is None else quantize_fp8_per_tensor(x2, input_scale)
    w_scale = weight_scale.float().reshape(-1)
    w_scale = w_scale.expand(n) if w_scale.numel() == 1 else w_scale
    y = (q.float() @ weight.float().t()) * x_scale.reshape(-1, 1) * w_scale.reshape(1, n)
    return _finish(y, bias, x, shape, n)


def fp8_block_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                         block_size: list[int], bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [*, N] = (x quantized per token per block_size[1] columns) @ block-dequantized weight^T (+ bias)."""
    bn, bk = block_size
    shape, n = x.shape, weight.shape[0]
    x2 = x.reshape(-1, shape[-1])
    q, x_scale = quantize_fp8_per_token_group(x2, bk)
    xd = q.float() * x_scale.repeat_interleave(bk, 1)[:, :x2.shape[1]]
    y = xd @ dequantize_fp8_block(weight, weight_scale_inv, (bn, bk)).t()
    return _finish(y, bias, x, shape, n)


# ---------------------------------------------------------------------------------------------
# device dispatch (custom ops: a compiled model sees one opaque node)


GEMV_TOKENS = 1  # tokens up to which the linears' tables take the FP8 GEMVs (measured faster there only)
# The weight-only GEMM: up to W8A16_TOKENS for every output width, up to W8A16_NARROW_TOKENS for outputs
# of at most W8A16_NARROW_N columns; it lost to _scaled_mm + quantizer on wider outputs at 32 tokens and
# everywhere at 64.
W8A16_TOKENS, W8A16_NARROW_TOKENS, W8A16_NARROW_N = 16, 32, 8192


def _triton_fp8_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """The Triton FP8 kernels: NVIDIA SM89+ (e4m3 conversions and MMAs), a float activation."""
    if device.type != "cuda" or torch.version.hip is not None or dtype not in (
            torch.bfloat16, torch.float16, torch.float32):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _scaled_mm_ok(device: torch.device, dtype: torch.dtype, k: int, n: int) -> bool:
    """torch._scaled_mm wants K and N multiples of 16, a bf16/fp16 x and an SM89+ (or ROCm MI300) device."""
    if device.type != "cuda" or k % 16 or n % 16 or dtype not in (torch.bfloat16, torch.float16):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


# The kernels of a per-channel / per-tensor table: (x2 [M, K], weight, weight_scale, input_scale, bias) -> [M, N].

def fp8_gemv(x2, weight, weight_scale, input_scale, bias):
    from atom_core.kernels.triton.fp8_gemv import fp8_channel_gemv

    return fp8_channel_gemv(x2.contiguous(), weight, weight_scale.float(), bias)


def fp8_w8a16(x2, weight, weight_scale, input_scale, bias):
    from atom_core.kernels.triton.fp8_w8a16 import fp8_w8a16_gemm

    return fp8_w8a16_gemm(x2, weight, weight_scale, bias)


def fp8_triton_gemm(x2, weight, weight_scale, input_scale, bias):
    from atom_core.kernels.triton.fp8_gemm import fp8_channel_gemm

    return fp8_channel_gemm(x2.contiguous(), weight, weight_scale.float(), input_scale, bias)


def fp8_scaled_mm(x2, weight, weight_scale, input_scale, bias):
    n = weight.shape[0]
    w_scale = weight_scale.float().reshape(-1)
    if input_scale is not None and w_scale.numel() == 1:  # per-tensor both sides
        q, x_scale = quantize_fp8_per_tensor(x2, input_scale)
        scale_a, scale_b = x_scale.reshape(()), w_scale.reshape(())
    else:  # row-wise: per-token activations, per-channel weights (a per-tensor weight scale expands)
        if input_scale is None:
            from atom_core.kernels.triton.fp8 import quantize_fp8_per_token as quantize_triton

            q, x_scale = quantize_triton(x2.contiguous())  # one launch (same bits as the reference)
        else:
            q, x_scale = quantize_fp8_per_tensor(x2, input_scale)
        scale_a = x_scale.reshape(-1, 1).expand(x2.shape[0], 1).contiguous()
        scale_b = w_scale.expand(n).reshape(1, n).contiguous()
    return torch._scaled_mm(q, weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=x2.dtype,
                            bias=None if bias is None else bias.to(x2.dtype))


def fp8_reference(x2, weight, weight_scale, input_scale, bias):
    return fp8_linear_ref(x2, weight, weight_scale, input_scale, bias)


def fp8_linear_table(device: torch.device, n: int, k: int, act_dtype: torch.dtype, static_input: bool) -> KernelTable:
    """The kernels of a per-channel / per-tensor FP8 linear with an [N, K] weight on `device` and
    activations in `act_dtype`; static_input: a checkpoint input_scale (no weight-only kernel)."""
    triton_ok = _triton_fp8_ok(device, act_dtype)
    scaled_mm_ok = _scaled_mm_ok(device, act_dtype, k, n)
    rows = []
    if triton_ok and not static_input:
        rows += [(GEMV_TOKENS, fp8_gemv), (W8A16_NARROW_TOKENS if n <= W8A16_NARROW_N else W8A16_TOKENS, fp8_w8a16)]
    large = fp8_triton_gemm if triton_ok and not scaled_mm_ok else fp8_scaled_mm if scaled_mm_ok else fp8_reference
    return KernelTable((*rows, (None, large)), act_dtype)


def _table(kernels: torch.Tensor | None, make) -> KernelTable:
    return make() if kernels is None else KernelTable.from_key(kernels)


@torch.library.custom_op("atom::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
               kernels: Optional[torch.Tensor] = None) -> torch.Tensor:
    """kernels: the key of the layer's `fp8_linear_table` (None: made for these arguments)."""
    shape, n = x.shape, weight.shape[0]
    x2 = x.reshape(-1, shape[-1])
    table = _table(kernels, lambda: fp8_linear_table(weight.device, n, shape[-1], x.dtype, input_scale is not None))
    assert table.dtype == x.dtype, f"FP8 kernel table made for {table.dtype} activations, got {x.dtype}"
    return table(x2.shape[0])(x2, weight, weight_scale, input_scale, bias).reshape(*shape[:-1], n)


@fp8_linear.register_fake
def _(x, weight, weight_scale, input_scale=None, bias=None, kernels=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


# The kernels of a block-FP8 table: (x2 [M, K], weight, weight_scale_inv, block_size, bias) -> [M, N].

def fp8_block_gemv(x2, weight, weight_scale_inv, block_size, bias):
    from atom_core.kernels.triton.fp8_gemv import fp8_block_gemv as gemv

    return gemv(x2.contiguous(), weight, weight_scale_inv.float(), block_size, bias)


def fp8_block_gemm(x2, weight, weight_scale_inv, block_size, bias):
    from atom_core.kernels.triton.fp8_gemm import fp8_block_gemm as gemm

    return gemm(x2.contiguous(), weight, weight_scale_inv.float(), block_size, bias)


def fp8_block_reference(x2, weight, weight_scale_inv, block_size, bias):
    return fp8_block_linear_ref(x2, weight, weight_scale_inv, block_size, bias)


def fp8_block_linear_table(device: torch.device, act_dtype: torch.dtype, block_size: list[int]) -> KernelTable:
    """The kernels of a block-FP8 linear: on NVIDIA SM89+ the block GEMV at 1 token (faster than the
    block GEMM on nearly every measured shape there, see docs/PERFORMANCE.md), then the block GEMM where it supports the block, else the
    reference; elsewhere the reference."""
    if not _triton_fp8_ok(device, act_dtype):
        return KernelTable(((None, fp8_block_reference),), act_dtype)
    from atom_core.kernels.triton.fp8_gemm import block_gemm_supported

    large = fp8_block_gemm if block_gemm_supported(block_size) else fp8_block_reference
    return KernelTable(((GEMV_TOKENS, fp8_block_gemv), (None, large)), act_dtype)


@torch.library.custom_op("atom::fp8_block_linear", mutates_args=())
def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                     block_size: list[int], bias: Optional[torch.Tensor] = None,
                     kernels: Optional[torch.Tensor] = None) -> torch.Tensor:
    """kernels: the key of the layer's `fp8_block_linear_table` (None: made for these arguments)."""
    x2 = x.reshape(-1, x.shape[-1])
    table = _table(kernels, lambda: fp8_block_linear_table(weight.device, x.dtype, block_size))
    assert table.dtype == x.dtype, f"FP8 kernel table made for {table.dtype} activations, got {x.dtype}"
    y = table(x2.shape[0])(x2, weight, weight_scale_inv, block_size, bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])


@fp8_block_linear.register_fake
def _(x, weight, weight_scale_inv, block_size, bias=None, kernels=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])
