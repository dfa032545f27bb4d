"""The quantization hook: a layer's parameters, their post-load repacking and its product come
from a `QuantMethod`, chosen per layer by a `QuantConfig` (one per checkpoint format).

A model file never names a format: it passes `quant_config` and a `prefix` to its layers, and
each layer asks `quant_config.get_quant_method(self, prefix)` (None: the unquantized method).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn


# Checkpoint tensors convert between these on load (bf16 weights into an fp32 model, ...);
# any other dtype (fp8, packed int32, int8) must arrive exactly as the parameter holds it.
CONVERTIBLE_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def copy_weight(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src: same shape; dtype converted only between the plain float types."""
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor shape {tuple(src.shape)} != parameter {tuple(dst.shape)}")
    if dst.dtype != src.dtype and not (dst.dtype in CONVERTIBLE_DTYPES and src.dtype in CONVERTIBLE_DTYPES):
        raise ValueError(f"checkpoint tensor dtype {src.dtype} cannot load into a {dst.dtype} parameter "
                         f"(only {', '.join(sorted(str(d) for d in CONVERTIBLE_DTYPES))} convert)")
    dst.copy_(src)


def set_weight_attrs(param: nn.Parameter, **attrs) -> None:
    """Attach loader metadata to a parameter (weight_loader, output_dim, input_dim, ...)."""
    for key, value in attrs.items():
        assert not hasattr(param, key), f"parameter already has attribute {key!r}"
        setattr(param, key, value)


class MoELayer(nn.Module):
    """The layer kind that holds stacked expert weights (`model_ops.moe.FusedMoE` derives from it):
    a QuantConfig gives it an MoE method. Defined here so quant/ tells experts from linear layers
    without importing model_ops/, which builds its layers on quant/."""


class QuantMethod(ABC):
    """Contract: `create_weights` registers every parameter of the layer (each with its
    `weight_loader`); the loader fills them; `process_weights_after_loading` may replace
    them with kernel layouts (once, after all are loaded); `apply` is the forward product."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, **sizes) -> None: ...

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Default: the loaded layout is the one `apply` reads."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor: ...


class QuantConfig(ABC):
    """A checkpoint's quantization format, parsed from `quantization_config` once."""

    name: str

    @classmethod
    @abstractmethod
    def from_config(cls, quantization_config: dict) -> "QuantConfig": ...

    @abstractmethod
    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantMethod | None:
        """The method for `layer` (e.g. "model.layers.3.self_attn.qkv_proj"); None keeps it unquantized."""
