"""The unquantized methods: plain weights in the model dtype, F.linear and the fused MoE kernel."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom_core.quant.base import QuantMethod, set_weight_attrs


class UnquantizedLinearMethod(QuantMethod):
    """weight [sum(output_sizes), input_size] in the default dtype; y = x W^T (+ b)."""

    def create_weights(self, layer: nn.Module, *, input_size: int, output_sizes: list[int],
                       weight_loader, params_dtype: torch.dtype | None = None) -> None:
        weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=params_dtype), requires_grad=False)
        set_weight_attrs(weight, weight_loader=weight_loader, output_dim=0, input_dim=1)
        layer.register_parameter("weight", weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


class UnquantizedFusedMoEMethod(QuantMethod):
    """Stacked expert weights w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I]."""

    def create_weights(self, layer: nn.Module, *, num_experts: int, hidden_size: int, intermediate_size: int,
                       weight_loader, params_dtype: torch.dtype | None = None) -> None:
        w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=params_dtype),
                           requires_grad=False)
        w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, dtype=params_dtype),
                          requires_grad=False)
        for param in (w13, w2):
            set_weight_attrs(param, weight_loader=weight_loader)
        layer.register_parameter("w13_weight", w13)
        layer.register_parameter("w2_weight", w2)

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              activation: str = "silu") -> torch.Tensor:
        return layer.ops.fused_moe(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, activation=activation)
