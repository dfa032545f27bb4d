"""Gated activations."""
from __future__ import annotations

import torch
from torch import nn

from atom_core.kernels import kernel_ops


class SiluAndMul(nn.Module):
    """x: [..., 2*I] -> silu(x[..., :I]) * x[..., I:]."""

    def __init__(self):
        super().__init__()
        self.ops = kernel_ops(torch.get_default_device())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(x)
