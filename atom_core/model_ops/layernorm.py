"""RMSNorm with an optional fused residual add."""
from __future__ import annotations

import torch
from torch import nn

from atom_core.kernels import kernel_ops


class RMSNorm(nn.Module):
    """forward(x) -> norm(x); forward(x, residual) -> (norm(x + residual), x + residual)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.ops = kernel_ops(self.weight.device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
