"""The unquantized methods: plain weights in the model dtype, F.linear and the fused MoE kernel.

Linears on CUDA go through `atom::dense_linear`, which runs the Triton GEMV
(kernels/triton/dense_gemv.py) at few tokens and F.linear above; a custom op, so torch.compile
keeps the token-count test inside it instead of specializing on it. ATOM_DENSE_SMALL_M_KERNEL:
auto (default) takes the GEMV at 1 token, where it beat cuBLAS on the H100 (Llama-3-8B batch-1
TPOT 6.45 -> 6.14 ms); at 2-4 tokens cuBLAS tied or won (docs/PERFORMANCE.md 2026-11-26, fourth
session), so only gemv sends those to it; linear is plain F.linear everywhere.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom_core.envs import DENSE_SMALL_M_KERNELS, DenseSmallMKernel, read_envs
from atom_core.quant.base import QuantMethod, set_weight_attrs

_small_m_kernel: DenseSmallMKernel = read_envs().dense_small_m_kernel


def set_dense_small_m_kernel(kind: DenseSmallMKernel) -> None:
    """For benchmarks and tests: the kernel of linears built or run from now on."""
    global _small_m_kernel
    if kind not in DENSE_SMALL_M_KERNELS:
        raise ValueError(f"unknown dense small-M kernel {kind!r}; expected one of: {', '.join(DENSE_SMALL_M_KERNELS)}")
    _small_m_kernel = kind


def _gemv_ok(x: torch.Tensor) -> bool:
    return x.is_cuda


AUTO_MAX_TOKENS = 1  # rows up to which `auto` takes the GEMV (measured faster there only)


def dense_linear_kernel(num_tokens: int, gemv_ok: bool, kind: str | None = None) -> str:
    """Which kernel a linear of `num_tokens` rows runs: "gemv" or "linear"."""
    from atom_core.kernels.triton.dense_gemv import MAX_TOKENS

    limit = {"gemv": MAX_TOKENS, "auto": AUTO_MAX_TOKENS}.get(kind or _small_m_kernel, 0)
    return "gemv" if gemv_ok and num_tokens <= limit else "linear"


@torch.library.custom_op("atom::dense_linear", mutates_args=())
def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    gemv_ok = _gemv_ok(x) and weight.dtype == x.dtype and weight.stride(-1) == 1  # the GEMV streams whole rows
    if dense_linear_kernel(x.numel() // max(1, x.shape[-1]), gemv_ok) == "gemv":
        from atom_core.kernels.triton.dense_gemv import dense_gemv

        return dense_gemv(x, weight, bias)
    return F.linear(x, weight, bias)


@dense_linear.register_fake
def _(x, weight, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def unquantized_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b): `atom::dense_linear` (the GEMV) where the token count is small enough on CUDA, else F.linear.

    Larger batches never see the custom op: Inductor plans a plain F.linear, and eager steps skip
    the op's dispatch. Under torch.compile the test on a symbolic token count becomes a guard, so
    each side of the threshold gets its own graph (with `auto` the threshold is 1, a size Dynamo
    specialises anyway)."""
    if _small_m_kernel == "linear" or not _gemv_ok(x):
        return F.linear(x, weight, bias)
    rows = x.numel() // max(1, x.shape[-1])
    return dense_linear(x, weight, bias) if dense_linear_kernel(rows, True) == "gemv" else F.linear(x, weight, bias)


class UnquantizedLinearMethod(QuantMethod):
    """weight [sum(output_sizes), input_size] in the default dtype; y = x W^T (+ b)."""

    def create_weights(self, layer: nn.Module, *, input_size: int, output_sizes: list[int],
                       weight_loader, params_dtype: torch.dtype | None = None) -> None:
        weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=params_dtype), requires_grad=False)
        set_weight_attrs(weight, weight_loader=weight_loader, output_dim=0, input_dim=1)
        layer.register_parameter("weight", weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return unquantized_linear(x, layer.weight, bias)


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
