"""GPTQ INT4 checkpoints (`quant_method: gptq`, as AutoGPTQ / GPTQModel write them), desc_act
false: every linear layer holds qweight / qzeros / scales / g_idx (layouts in quant/int4.py)."""
from __future__ import annotations

from torch import nn

from atom_core.quant.base import MoELayer, QuantConfig, QuantMethod
from atom_core.quant.int4 import GPTQW4A16Method


class GPTQConfig(QuantConfig):
    name = "gptq"

    def __init__(self, group_size: int | None, symmetric: bool, zero_offset: int):
        self.group_size, self.symmetric, self.zero_offset = group_size, symmetric, zero_offset

    @classmethod
    def from_config(cls, qc: dict) -> "GPTQConfig":
        bits = int(qc.get("bits", 4))
        if bits != 4:
            raise ValueError(f"GPTQ bits={bits} is not supported; supported: 4")
        if qc.get("desc_act"):
            raise ValueError("GPTQ desc_act=true (act-order) checkpoints are not supported; supported: desc_act false")
        if qc.get("lm_head"):
            raise ValueError("GPTQ with a quantized lm_head is not supported")
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported; supported: gptq, gptq_v2")
        group = int(qc.get("group_size", 128))
        if group != -1 and (group <= 0 or group % 32):
            raise ValueError(f"GPTQ group_size={group} is not supported; supported: -1 or a multiple of 32")
        # v1 stores zero - 1 (AutoGPTQ's historical offset); v2 stores the zero itself.
        return cls(None if group == -1 else group, bool(qc.get("sym", True)), 1 if fmt == "gptq" else 0)

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantMethod | None:
        if isinstance(layer, MoELayer):
            raise ValueError(f"{prefix}: GPTQ-quantized MoE experts are not supported yet (dense linear layers only)")
        return GPTQW4A16Method(self.group_size, self.symmetric, self.zero_offset)
