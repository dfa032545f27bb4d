"""Kernel providers. Each provider module exposes the same functions as `torch_ref`.

`kernel_ops(device)` picks the provider for a device: Triton on CUDA/ROCm GPUs,
plain PyTorch on the CPU. Callers never import a provider directly.
"""
from __future__ import annotations

from types import ModuleType

import torch


def kernel_ops(device: torch.device | str) -> ModuleType:
    device = torch.device(device)
    if device.type == "cuda":
        from atom_core.kernels import triton as triton_ops

        return triton_ops
    from atom_core.kernels import torch_ref

    return torch_ref
