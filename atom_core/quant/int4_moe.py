"""W4A16 MoE experts: compressed-tensors `pack-quantized` int4 experts (llm-compressor W4A16 on a
MoE model), the torch reference of `kernels/triton/moe_w4a16.fused_moe_w4a16` (same signature),
and the quant method that loads the one into the other's layout.

Checkpoint (llm-compressor 0.14 writes a MoE model's experts one Linear at a time, whatever the
transformers version fuses in memory): `experts.N.{gate,up,down}_proj.weight_packed` int32 [R, C/8]
(value q in [-8, 7] stored as q + 8, nibble k % 8 of word k // 8), `weight_scale` [R, C/G],
`weight_shape` int64 [2] = [R, C]. That is int_ops' canonical int4 layout with zero 8, so the
method stacks it per expert as it is: w13_weight_packed [E, 2I, H/8] (gate rows, then up rows),
w13_weight_scale [E, 2I, H/G], w2_weight_packed [E, H, I/8], w2_weight_scale [E, H, I/G], scales in
the model dtype. Symmetric groups of 32/64/128 (one group size for both GEMMs); asymmetric or
per-channel experts fail at start with a message. Tensor parallelism slices I: the gate/up rows,
and down's packed words and scale groups, so I per rank must be a multiple of the group size.
"""
from __future__ import annotations

import torch
from torch import nn

from atom_core.kernels import moe_ref
from atom_core.quant.base import QuantMethod, set_weight_attrs
from atom_core.quant.int_ops import INT4_PER_INT32, dequantize_int4


def dequantize_experts(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                       group_size: int) -> torch.Tensor:
    """[E, N, K/8] int32 words, [E, N, K/G] scales, zeros or None -> [E, N, K] in the scales' dtype."""
    out = torch.empty(*packed.shape[:2], packed.shape[2] * INT4_PER_INT32, dtype=scale.dtype, device=scale.device)
    for e in range(packed.shape[0]):  # one expert at a time: no second copy of the whole stack
        out[e] = dequantize_int4(packed[e], scale[e], None if zero is None else zero[e], group_size)
    return out


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


class CompressedTensorsW4A16MoEMethod(QuantMethod):
    """compressed-tensors pack-quantized int4 experts (symmetric, grouped): see the module docstring.
    The product: the fused Triton kernel on CUDA, `fused_moe_w4a16_ref` elsewhere."""

    def __init__(self, group_size: int):
        self.group_size = group_size

    def create_weights(self, layer: nn.Module, *, num_experts: int, hidden_size: int, intermediate_size: int,
                       weight_loader, has_bias: bool = False, params_dtype: torch.dtype | None = None) -> None:
        g = self.group_size
        if has_bias:
            raise ValueError(f"{layer.prefix}: W4A16 experts with biases (e.g. GPT-OSS) are not supported")
        if hidden_size % g or intermediate_size % g:
            raise ValueError(f"{layer.prefix}: W4A16 experts need H={hidden_size} and the intermediate size per "
                             f"rank {intermediate_size} to be multiples of the group size {g}; use expert "
                             f"parallelism or another tensor-parallel size")
        dtype = params_dtype or torch.get_default_dtype()
        experts = range(layer.expert_start, layer.expert_start + num_experts)
        shapes = {"w13": (2 * intermediate_size, hidden_size), "w2": (hidden_size, intermediate_size)}
        for name, (rows, cols) in shapes.items():
            shards = frozenset((s, e) for e in experts for s in (("w1", "w3") if name == "w13" else ("w2",)))
            for suffix, shape, pdtype in (("weight_packed", (rows, cols // INT4_PER_INT32), torch.int32),
                                          ("weight_scale", (rows, cols // g), dtype)):
                param = nn.Parameter(torch.empty(num_experts, *shape, dtype=pdtype), requires_grad=False)
                set_weight_attrs(param, weight_loader=weight_loader)
                param.expected_shards = shards
                layer.register_parameter(f"{name}_{suffix}", param)
            shape_param = nn.Parameter(torch.empty(2, dtype=torch.int64), requires_grad=False)
            set_weight_attrs(shape_param, weight_loader=self._shape_checker(layer, hidden_size, intermediate_size))
            shape_param.expected_shards = shards
            layer.register_parameter(f"{name}_weight_shape", shape_param)

    @staticmethod
    def _shape_checker(layer: nn.Module, hidden_size: int, intermediate_size: int):
        """weight_shape is the checkpoint Linear's unpacked [R, C]: check it, keep nothing."""
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None, expert_id=None) -> None:
            inter = intermediate_size * (1 if layer.use_ep else layer.tp_size)
            expected = [hidden_size, inter] if shard_id == "w2" else [inter, hidden_size]
            if loaded.tolist() != expected:
                raise ValueError(f"{layer.prefix}: expert {expert_id} {shard_id} weight_shape {loaded.tolist()}, "
                                 f"expected {expected}")
        return load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        for name in ("w13_weight_shape", "w2_weight_shape"):
            if hasattr(layer, name):
                delattr(layer, name)

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              activation: str = "silu", swiglu_limit: float | None = None) -> torch.Tensor:
        if x.is_cuda:
            from atom_core.kernels.triton.moe_w4a16 import fused_moe_w4a16 as moe
        else:
            moe = fused_moe_w4a16_ref
        return moe(x, layer.w13_weight_packed, layer.w13_weight_scale, None, layer.w2_weight_packed,
                   layer.w2_weight_scale, None, topk_weights, topk_ids, self.group_size, activation, swiglu_limit)


def compressed_tensors_moe_method(scheme, prefix: str) -> QuantMethod:
    """The MoE method for a compressed-tensors scheme (`compressed_tensors.Scheme`) of the experts'
    Linears; ValueError naming what is not supported."""
    w, a = scheme.weights, scheme.input_activations
    supported = (scheme.format == "pack-quantized" and a is None and w is not None and w.type == "int"
                 and w.num_bits == 4 and w.strategy == "group" and w.symmetric and w.group_size in (32, 64, 128)
                 and w.actorder != "group")
    if not supported:
        what = "no weights" if w is None else w.describe()
        raise ValueError(f"{prefix}: compressed-tensors MoE experts with format {scheme.format!r}, weights {what}"
                         f"{'' if a is None else ', input activations ' + a.describe()} are not supported; "
                         f"experts run pack-quantized W4A16 only (int4, symmetric, group_size 32/64/128)")
    return CompressedTensorsW4A16MoEMethod(w.group_size)
