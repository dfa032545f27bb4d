"""W8A8 INT8 linear method: int8 weights with a float32 scale per output channel, activations
quantized to int8 per token on the fly (dynamic, symmetric), int32 accumulation.

Tensor parallelism: the weight splits like a bf16 one (N or K); the per-channel scale follows N.
"""
from __future__ import annotations

import torch
from torch import nn

from atom_core.quant.base import QuantMethod, set_weight_attrs
from atom_core.quant.int_ops import int8_w8a8_gemm


class Int8W8A8LinearMethod(QuantMethod):
    """weight int8 [N, K], weight_scale float32 [N, 1] (compressed-tensors `int-quantized`)."""

    def create_weights(self, layer: nn.Module, *, input_size: int, output_sizes: list[int], weight_loader,
                       params_dtype: torch.dtype | None = None) -> None:
        n = sum(output_sizes)
        weight = nn.Parameter(torch.empty(n, input_size, dtype=torch.int8), requires_grad=False)
        set_weight_attrs(weight, weight_loader=weight_loader, output_dim=0, input_dim=1)
        scale = nn.Parameter(torch.empty(n, 1, dtype=torch.float32), requires_grad=False)
        set_weight_attrs(scale, weight_loader=weight_loader, output_dim=0)
        layer.register_parameter("weight", weight)
        layer.register_parameter("weight_scale", scale)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return int8_w8a8_gemm(x, layer.weight, layer.weight_scale, bias)
