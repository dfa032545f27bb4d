"""The unquantized methods: plain weights in the model dtype, F.linear and the fused MoE kernel.

A linear's kernels are a per-M table made when it is built (`dense_linear_table`): on CUDA the
Triton GEMV (kernels/triton/dense_gemv.py) at 1 token, where it beat cuBLAS (at 2-4 tokens cuBLAS
tied or won), F.linear above; on other devices F.linear. The GEMV runs through `atom::dense_linear`,
a custom op, so torch.compile keeps it opaque; larger batches never see the op: Inductor plans a
plain F.linear, and eager steps skip the op's dispatch.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from atom_core.kernel_config import KernelTable
from atom_core.quant.base import QuantMethod, set_weight_attrs

GEMV_TOKENS = 1  # rows up to which a linear on CUDA takes the GEMV


@torch.library.custom_op("atom::dense_linear", mutates_args=())
def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) by the Triton GEMV (at most dense_gemv.MAX_TOKENS rows of x); F.linear for a weight
    the GEMV cannot stream (another dtype than x, or rows that are not contiguous)."""
    if weight.dtype == x.dtype and weight.stride(-1) == 1:
        from atom_core.kernels.triton.dense_gemv import dense_gemv

        return dense_gemv(x, weight, bias)
    return F.linear(x, weight, bias)


@dense_linear.register_fake
def _(x, weight, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def dense_linear_table(device: torch.device | str) -> KernelTable:
    """The kernels of an unquantized linear whose weight lives on `device`: one table per device
    type, shared by every such linear (it depends on nothing else)."""
    return _dense_linear_table(torch.device(device).type)


@functools.lru_cache(maxsize=None)
def _dense_linear_table(device_type: str) -> KernelTable:
    if device_type == "cuda":
        return KernelTable(((GEMV_TOKENS, dense_linear), (None, F.linear)))
    return KernelTable(((None, F.linear),))


def unquantized_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       table: KernelTable) -> torch.Tensor:
    """x W^T (+ b) by the kernel `table` gives x's token count. Under torch.compile the lookup runs at
    trace time on a symbolic count, which Dynamo takes as >= 2 (1 is specialised): a graph for 1 token
    calls the GEMV op, every other graph F.linear, with no guard on the count."""
    rows = x.numel() // max(1, x.shape[-1])
    return table(rows)(x, weight, bias)


class UnquantizedLinearMethod(QuantMethod):
    """weight [sum(output_sizes), input_size] in the default dtype; y = x W^T (+ b)."""

    def create_weights(self, layer: nn.Module, *, input_size: int, output_sizes: list[int],
                       weight_loader, params_dtype: torch.dtype | None = None) -> None:
        weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=params_dtype), requires_grad=False)
        set_weight_attrs(weight, weight_loader=weight_loader, output_dim=0, input_dim=1)
        layer.register_parameter("weight", weight)
        layer.kernel_table = dense_linear_table(weight.device)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return unquantized_linear(x, layer.weight, bias, layer.kernel_table)


class UnquantizedFusedMoEMethod(QuantMethod):
    """Stacked expert weights w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I]; with
    has_bias, w13_bias [E, 2I] and w2_bias [E, H] in the model dtype (as HF holds them)."""

    def create_weights(self, layer: nn.Module, *, num_experts: int, hidden_size: int, intermediate_size: int,
                       weight_loader, has_bias: bool = False, params_dtype: torch.dtype | None = None) -> None:
        w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=params_dtype),
                           requires_grad=False)
        w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, dtype=params_dtype),
                          requires_grad=False)
        for param in (w13, w2):
            set_weight_attrs(param, weight_loader=weight_loader)
        layer.register_parameter("w13_weight", w13)
        layer.register_parameter("w2_weight", w2)
        if has_bias:
            register_moe_biases(layer, num_experts, hidden_size, intermediate_size, weight_loader, params_dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              activation: str = "silu", swiglu_limit: float | None = None) -> torch.Tensor:
        return layer.ops.fused_moe(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, activation=activation,
                                   w13_bias=getattr(layer, "w13_bias", None), w2_bias=getattr(layer, "w2_bias", None),
                                   swiglu_limit=swiglu_limit)


def register_moe_biases(layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int,
                        weight_loader, params_dtype: torch.dtype | None = None) -> None:
    """The expert biases a MoE method with has_bias registers: w13_bias [E, 2I] (gate, then up;
    split over TP ranks like w13's rows) and w2_bias [E, H] (whole on every rank; the layer's
    loader zeroes it off rank 0 under TP, see FusedMoE.weight_loader)."""
    for name, cols in (("w13_bias", 2 * intermediate_size), ("w2_bias", hidden_size)):
        bias = nn.Parameter(torch.empty(num_experts, cols, dtype=params_dtype), requires_grad=False)
        set_weight_attrs(bias, weight_loader=weight_loader)
        layer.register_parameter(name, bias)
