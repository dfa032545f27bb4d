"""The quantized FusedMoE layer the fused-kernel layer tests (FP8 block, W4A16) run on CUDA."""
from __future__ import annotations

import torch


def bf16_moe_layer(quant_config, weights: dict[str, torch.Tensor], device: str = "cuda"):
    """8 experts, hidden 256, intermediate 128, top-2 renormalized, built with bf16 as the
    default dtype on `device` (quantized parameters keep their own dtypes); each parameter named
    in `weights` is then filled from it."""
    from atom_core.model_ops.moe import FusedMoE, MoERouting

    with torch.device(device):
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            layer = FusedMoE(8, 256, 128, MoERouting(top_k=2, renormalize=True), "mlp.experts", quant_config)
        finally:
            torch.set_default_dtype(old)
    for name, value in weights.items():
        getattr(layer, name).data.copy_(value)
    return layer
