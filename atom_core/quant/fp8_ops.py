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
  fp8_linear / fp8_block_linear: the same signatures as custom ops (`atom::fp8_linear`,
      `atom::fp8_block_linear`). Off NVIDIA SM89+ GPUs: the references (fp8_linear: also
      torch._scaled_mm on a ROCm device where the shape allows it). On NVIDIA SM89+
      (`fp8_linear_kernel` / `fp8_block_linear_kernel` decide, per ATOM_FP8_SMALL_M_KERNEL, read
      when this module is imported; `set_small_m_kernel` for benchmarks and tests):
      - fp8_block_linear: the Triton block-FP8 GEMM (kernels/triton/fp8_gemm.py); the block GEMV
        (kernels/triton/fp8_gemv.py) at 1 token under `auto` and up to 4 tokens under `gemv`.
      - fp8_linear: torch._scaled_mm (row-wise or per-tensor scales, dynamic activations
        quantized by one Triton launch, kernels/triton/fp8.py) where the shape allows it (K and N
        multiples of 16, bf16/fp16 x), else the Triton GEMM. Few tokens:
        - `auto` (default): the weight-only FP8 GEMV (kernels/triton/fp8_gemv.py: x not quantized,
          so closer to the bf16 product than these references) at 1 token with dynamic
          activations: Llama-3-8B fp8 batch-1 TPOT 5.71 -> 4.27 ms on the H100; at 2-16 tokens the
          weight-only GEMM (kernels/triton/fp8_w8a16.py), at 17-32 that GEMM for outputs of at
          most 8,192 columns and _scaled_mm for wider ones, _scaled_mm above;
        - `gemv`: the GEMV at M <= GEMV_MAX_TOKENS for both ops (a static input_scale is part of
          the checkpoint's arithmetic and keeps its path);
        - `triton`: the Triton GEMM (activation quantization fused in, split-K) at M <= SMALL_M_MAX;
        - `scaled_mm`: _scaled_mm at every M;
        - `w8a16`: the GEMV at 1 token, then the weight-only GEMM (kernels/triton/fp8_w8a16.py: x
          not quantized, no quantizer launch) at 2-64 tokens, for dynamic per-channel FP8.

The references accumulate in float32 over the dequantized operands, which equals the sum over
K-blocks of the fp8 partial products times their scales up to float32 rounding.
"""
from __future__ import annotations

from typing import Optional

import torch

from atom_core.envs import FP8_SMALL_M_KERNELS, Fp8SmallMKernel, check_choice, read_envs
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


AUTO_GEMV_MAX_TOKENS = 1  # tokens up to which `auto` takes the per-channel GEMV (measured faster there)
FP8_LINEAR_KERNELS = ("reference", "scaled_mm", "triton", "gemv", "w8a16")
W8A16_MAX_TOKENS = 64  # tokens up to which `w8a16` takes the weight-only GEMM (kernels/triton/fp8_w8a16.py)
# `auto` takes it at 2-16 tokens, and at 17-32 for outputs of at most 8,192 columns: it beat
# _scaled_mm + quantizer there on Llama-3-8B's shapes and lost on gate_up (N 28,672) at 32 tokens and
# everywhere at 64 (H100, docs/PERFORMANCE.md 2026-11-26, seventh session)
W8A16_AUTO_ALL_N_TOKENS, W8A16_AUTO_MAX_TOKENS, W8A16_AUTO_MAX_N = 16, 32, 8192
_small_m_kernel: Fp8SmallMKernel = read_envs().fp8_small_m_kernel


def _gemv_max_tokens(small_m: Fp8SmallMKernel) -> int:
    """Tokens up to which the switch takes the FP8 GEMV (per-channel and block alike)."""
    return {"gemv": GEMV_MAX_TOKENS, "auto": AUTO_GEMV_MAX_TOKENS, "w8a16": AUTO_GEMV_MAX_TOKENS}.get(small_m, 0)


def set_small_m_kernel(kind: Fp8SmallMKernel) -> None:
    """Process-wide choice for per-channel fp8_linear at M <= SMALL_M_MAX on CUDA (benchmarks, tests;
    an engine takes ATOM_FP8_SMALL_M_KERNEL). Not for use while a CUDA graph is captured or replayed:
    a captured graph keeps the kernel it recorded."""
    global _small_m_kernel
    _small_m_kernel = check_choice(kind, FP8_SMALL_M_KERNELS, "FP8 small-M kernel")


def small_m_kernel() -> Fp8SmallMKernel:
    return _small_m_kernel


def _triton_fp8_ok(x2: torch.Tensor) -> bool:
    """The Triton FP8 GEMM: NVIDIA SM89+ (e4m3 conversions and MMAs), a float activation."""
    if x2.device.type != "cuda" or torch.version.hip is not None or x2.dtype not in (
            torch.bfloat16, torch.float16, torch.float32):
        return False
    return torch.cuda.get_device_capability(x2.device) >= (8, 9)


def _scaled_mm_ok(x2: torch.Tensor, weight: torch.Tensor) -> bool:
    """torch._scaled_mm wants K and N multiples of 16, a bf16/fp16 x and an SM89+ (or ROCm MI300) device."""
    if x2.device.type != "cuda" or x2.shape[1] % 16 or weight.shape[0] % 16:
        return False
    if x2.dtype not in (torch.bfloat16, torch.float16):
        return False
    return torch.cuda.get_device_capability(x2.device) >= (8, 9)


def fp8_linear_kernel(num_tokens: int, scaled_mm_ok: bool, triton_ok: bool,
                      small_m: Fp8SmallMKernel | None = None, static_input: bool = False,
                      out_features: int | None = None) -> str:
    """Which of FP8_LINEAR_KERNELS runs a per-channel/per-tensor fp8_linear of `num_tokens` rows and
    `out_features` output columns (None: any)."""
    small_m = small_m or _small_m_kernel
    if triton_ok and num_tokens <= _gemv_max_tokens(small_m) and not static_input:
        return "gemv"
    narrow = num_tokens <= W8A16_AUTO_ALL_N_TOKENS or out_features is None or out_features <= W8A16_AUTO_MAX_N
    if triton_ok and not static_input and (
            (small_m == "w8a16" and num_tokens <= W8A16_MAX_TOKENS)
            or (small_m == "auto" and num_tokens <= W8A16_AUTO_MAX_TOKENS and narrow)):
        return "w8a16"
    if triton_ok and (not scaled_mm_ok or (num_tokens <= SMALL_M_MAX and small_m == "triton")):
        return "triton"
    return "scaled_mm" if scaled_mm_ok else "reference"


@torch.library.custom_op("atom::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    shape, n = x.shape, weight.shape[0]
    x2 = x.reshape(-1, shape[-1])
    kernel = fp8_linear_kernel(x2.shape[0], _scaled_mm_ok(x2, weight), _triton_fp8_ok(x2),
                               static_input=input_scale is not None, out_features=n)
    if kernel == "reference":
        return fp8_linear_ref(x, weight, weight_scale, input_scale, bias)
    if kernel == "gemv":
        from atom_core.kernels.triton.fp8_gemv import fp8_channel_gemv

        return fp8_channel_gemv(x2.contiguous(), weight, weight_scale.float(), bias).reshape(*shape[:-1], n)
    if kernel == "w8a16":
        from atom_core.kernels.triton.fp8_w8a16 import fp8_w8a16_gemm

        return fp8_w8a16_gemm(x2, weight, weight_scale, bias).reshape(*shape[:-1], n)
    if kernel == "triton":
        from atom_core.kernels.triton.fp8_gemm import fp8_channel_gemm

        return fp8_channel_gemm(x2.contiguous(), weight, weight_scale.float(), input_scale, bias).reshape(*shape[:-1], n)
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
    y = torch._scaled_mm(q, weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=x.dtype,
                         bias=None if bias is None else bias.to(x.dtype))
    return y.reshape(*shape[:-1], n)


@fp8_linear.register_fake
def _(x, weight, weight_scale, input_scale=None, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def fp8_block_linear_kernel(num_tokens: int, triton_ok: bool, small_m: Fp8SmallMKernel | None = None) -> str:
    """Which kernel runs a block-FP8 fp8_block_linear: "gemv" (1 token under `auto`, M <= GEMV_MAX_TOKENS
    under `gemv`), "triton" (the block GEMM where it supports the block, else the reference) or "reference".
    `auto` takes the block GEMV at 1 token since it beat the block GEMM on 10 of 11 measured shapes
    (Qwen3-30B-A3B, Llama-3-8B, DeepSeek-V3; PERFORMANCE.md 2026-11-26, seventh session)."""
    if not triton_ok:
        return "reference"
    return "gemv" if num_tokens <= _gemv_max_tokens(small_m or _small_m_kernel) else "triton"


@torch.library.custom_op("atom::fp8_block_linear", mutates_args=())
def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                     block_size: list[int], bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    kernel = fp8_block_linear_kernel(x2.shape[0], _triton_fp8_ok(x2))
    if kernel == "gemv":
        from atom_core.kernels.triton.fp8_gemv import fp8_block_gemv

        y = fp8_block_gemv(x2.contiguous(), weight, weight_scale_inv.float(), block_size, bias)
        return y.reshape(*x.shape[:-1], weight.shape[0])
    if kernel == "triton":
        from atom_core.kernels.triton.fp8_gemm import block_gemm_supported, fp8_block_gemm

        if block_gemm_supported(block_size):
            y = fp8_block_gemm(x2.contiguous(), weight, weight_scale_inv.float(), block_size, bias)
            return y.reshape(*x.shape[:-1], weight.shape[0])
    return fp8_block_linear_ref(x, weight, weight_scale_inv, block_size, bias)


@fp8_block_linear.register_fake
def _(x, weight, weight_scale_inv, block_size, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])
