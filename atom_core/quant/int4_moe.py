"""W4A16 MoE experts: the torch reference of `kernels/triton/moe_w4a16.fused_moe_w4a16` (same
signature), in the canonical int4 layout of `quant/int_ops.py` stacked per expert.

Not here yet: a quant method that loads compressed-tensors `pack-quantized` experts
(`experts.N.{gate,up,down}_proj.weight_packed / weight_scale / weight_shape`, as llm-compressor
writes a MoE model) into this layout. compressed-tensors MoE experts are refused at start until it
exists (quant/compressed_tensors.py); the loader's per-expert rules
(`model_ops/moe.make_expert_params_mapping`) would need those suffixes too.
"""
from __future__ import annotations

import torch

from atom_core.kernels import moe_ref
from atom_core.quant.int_ops import dequantize_int4


def dequantize_experts(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                       group_size: int) -> torch.Tensor:
    """[E, N, K/8] int32 words, [E, N, K/G] scales, zeros or None -> [E, N, K] in the scales' dtype."""
    return torch.stack([dequantize_int4(packed[e], scale[e], None if zero is None else zero[e], group_size)
                        for e in range(packed.shape[0])])


def fused_moe_w4a16_ref(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H/8] int32: gate rows then up rows
    w13_scale: torch.Tensor,  # [E, 2I, H/G] hidden's dtype
    w13_zero: torch.Tensor | None,  # [E, 2I, H/G] uint8, or None (symmetric: zero 8)
    w2: torch.Tensor,  # [E, H, I/8] int32
    w2_scale: torch.Tensor,  # [E, H, I/G]
    w2_zero: torch.Tensor | None,  # [E, H, I/G] uint8, or None
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int
    group_size: int = 128,
    activation: str = "silu",
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """The experts dequantized (`int_ops.dequantize_int4`: (u - zero) * scale in the scales' dtype),
    then `moe_ref.fused_moe` (its precision contract; ids outside [0, E) dropped)."""
    w13_d = dequantize_experts(w13, w13_scale, w13_zero, group_size)
    w2_d = dequantize_experts(w2, w2_scale, w2_zero, group_size)
    return moe_ref.fused_moe(hidden, w13_d, w2_d, topk_weights, topk_ids, activation, swiglu_limit=swiglu_limit)
