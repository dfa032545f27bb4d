"""Shared by the kernel tests: whether Triton runs interpreted, and how close a kernel must be."""
import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Relative L2 error bounds. bf16 needs the wide one partly because Triton's interpreter rounds
# fp32 -> bf16 by truncation (GPUs round to nearest), a bias of up to one bf16 ulp.
TOL = {torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "kernel left NaN (unwritten or invalid) elements"
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def widen_fp8_dot_on_cuda(monkeypatch, device: str, *modules) -> None:
    """Float32 comparisons of FP8 kernels check their logic with the widened dot on CUDA (bf16
    operands hold every e4m3 value exactly; float32 accumulation). Hopper's native e4m3 MMA
    accumulates with fewer bits than float32 inside one K step (about 14, per the DeepSeek-V3
    report): on the H100 (2026-11-26) that alone gave relative errors of 8.7e-5 (dense GEMM) and
    3.5e-3 to 5.4e-3 (the MoE, whose intermediate is re-quantized) on wgmma-sized tiles. The native
    dot is covered at bf16 tolerance by the half-precision and model-shape tests."""
    if device == "cuda":
        for module in modules:
            monkeypatch.setattr(module, "dot_mode", lambda _device: 1)
