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
