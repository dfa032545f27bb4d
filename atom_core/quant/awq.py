"""AWQ INT4 checkpoints (`quant_method: awq`, AutoAWQ's GEMM layout): every linear layer holds
qweight / qzeros / scales (layouts in quant/int4.py); `modules_to_not_convert` stay unquantized."""
from __future__ import annotations

from torch import nn

from atom_core.quant.base import MoELayer, QuantConfig, QuantMethod
from atom_core.quant.int4 import AWQW4A16Method


class AWQConfig(QuantConfig):
    name = "awq"

    def __init__(self, group_size: int, modules_to_not_convert: list[str]):
        self.group_size, self.modules_to_not_convert = group_size, modules_to_not_convert

    @classmethod
    def from_config(cls, qc: dict) -> "AWQConfig":
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        if bits != 4:
            raise ValueError(f"AWQ bits={bits} is not supported; supported: 4")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported; supported: gemm")
        if not qc.get("zero_point", True):
            raise ValueError("AWQ zero_point=false is not supported; supported: zero_point true")
        group = int(qc.get("group_size", qc.get("q_group_size", 128)))
        if group <= 0 or group % 32:
            raise ValueError(f"AWQ group_size={group} is not supported; supported: a multiple of 32")
        return cls(group, list(qc.get("modules_to_not_convert") or []))

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantMethod | None:
        if any(name in prefix for name in self.modules_to_not_convert):
            return None
        if isinstance(layer, MoELayer):
            raise ValueError(f"{prefix}: AWQ-quantized MoE experts are not supported yet (dense linear layers only)")
        return AWQW4A16Method(self.group_size, symmetric=False)
