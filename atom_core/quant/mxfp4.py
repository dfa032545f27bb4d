"""MXFP4 (`quant_method: mxfp4`): GPT-OSS's expert weights, OCP microscaling FP4.

Format (checked against transformers' `integrations/mxfp4.py` and its GPT-OSS conversion script):
  quantization_config {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                       "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
  per MoE layer `...mlp.experts.`:
    gate_up_proj_blocks uint8 [E, 2I, H/32, 16]  two e2m1 values a byte, the low nibble first
    gate_up_proj_scales uint8 [E, 2I, H/32]      e8m0 exponents: each 32 values scale by 2^(s - 127)
    gate_up_proj_bias         [E, 2I]            model dtype
    down_proj_blocks / _scales / _bias           [E, H, I/32, 16] / [E, H, I/32] / [E, H]
  The 2I rows of gate_up are interleaved: gate = even rows, up = odd rows (HF's `_apply_gate`
  reads `gate_up[..., ::2]` and `[..., 1::2]` of the dequantized [E, H, 2I] weight).

Only MoE experts are quantized: HF's `replace_with_mxfp4_linear` converts nothing but the GPT-OSS
experts, so every other layer (attention, router, embeddings, lm_head, any dense linear) stays in
the model dtype here too: `get_quant_method` returns None for it. A checkpoint that quantizes
some other linear in MXFP4 fails at load ("checkpoint tensor ... has no matching parameter").

Layout here: w13_weight uint8 [E, 2I, H/2] (gate rows, then up rows: de-interleaved at load),
w13_weight_scale float8_e8m0fnu [E, 2I, H/32], w2_weight uint8 [E, H, I/2], w2_weight_scale
[E, H, I/32], biases w13_bias [E, 2I] / w2_bias [E, H] in the model dtype. The scales are kept
as e8m0 (the same bytes) rather than uint8 so that dummy weights are sane: the dummy loader fills
float parameters with small values, which become exponents near 2^-10, where random uint8 scales
would reach 2^127 and overflow.

Tensor parallel: rows of w13 (each of gate and up) and whole 32-value groups of w2's K, so the
intermediate size per rank must be a multiple of 32 (gpt-oss: I=2880 splits over tp 2, 3, 5, 6,
9 or 10, not 4 or 8: use expert parallelism there). w2's bias is added by rank 0 only (the ranks'
partial sums are all-reduced). Expert parallel: whole experts.

The product: the Triton kernel on CUDA/ROCm (`kernels/triton/moe_mxfp4.py`, dequantizing in its
inner loop), and on the CPU `fused_moe_mxfp4_ref` (dequantize the experts it needs exactly as HF
does, then the bf16 MoE reference).
"""
from __future__ import annotations

import re
from typing import Literal, Optional

import torch
from torch import nn

from atom_core.quant.base import MoELayer, QuantConfig, QuantMethod, set_weight_attrs

# e2m1 by nibble: sign bit 3, exponent bits 2-1, mantissa bit 0 (the OCP MX table, as HF's FP4_VALUES)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32  # values per e8m0 scale
SCALE_DTYPE = torch.float8_e8m0fnu


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """uint8 view of a uint8 or e8m0 tensor (checkpoints store the scales as U8, some as F8_E8M0)."""
    if t.dtype == torch.uint8:
        return t
    if t.dtype == SCALE_DTYPE:
        return t.view(torch.uint8)
    raise ValueError(f"MXFP4 blocks and scales must be uint8 (or e8m0 scales), got {t.dtype}")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks uint8 [..., K/2] or [..., K/32, 16], scales [..., K/32] -> [..., K] in `dtype`.

    The same arithmetic as HF's `convert_moe_packed_tensors` (a table of e2m1 values in `dtype`,
    then `torch.ldexp` by s - 127), hence its bits; HF also transposes the last two dims of
    [E, rows, K], we do not.
    """
    blocks, scales = _bytes(blocks), _bytes(scales)
    if blocks.dim() == scales.dim() + 1:  # [..., K/32, 16]
        blocks = blocks.flatten(-2)
    lead, num_groups = scales.shape[:-1], scales.shape[-1]
    if blocks.shape != (*lead, num_groups * MXFP4_BLOCK // 2):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         f"(need [..., K/2] bytes for [..., K/32] scales)")
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    out = torch.empty(*lead, num_groups * MXFP4_BLOCK, dtype=dtype, device=blocks.device)
    out[..., 0::2] = lut[(blocks & 0x0F).int()]
    out[..., 1::2] = lut[(blocks >> 4).int()]
    groups = out.view(*lead, num_groups, MXFP4_BLOCK)
    torch.ldexp(groups, (scales.int() - 127).unsqueeze(-1), out=groups)
    return out


def fused_moe_mxfp4_ref(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H/2] uint8: gate rows then up rows
    w13_scale: torch.Tensor,  # [E, 2I, H/32] uint8 (e8m0)
    w2: torch.Tensor,  # [E, H, I/2] uint8
    w2_scale: torch.Tensor,  # [E, H, I/32]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int32
    activation: str = "silu",
    w13_bias: Optional[torch.Tensor] = None,  # [E, 2I]
    w2_bias: Optional[torch.Tensor] = None,  # [E, H]
    swiglu_limit: Optional[float] = None,
) -> torch.Tensor:
    """The CPU path and the oracle of `kernels/triton/moe_mxfp4.fused_moe_mxfp4` (same signature):
    the experts the tokens chose, dequantized to hidden's dtype as HF does, then
    `moe_ref.fused_moe` (its precision: each matmul and the activation rounded to hidden's dtype)."""
    from atom_core.kernels import moe_ref

    num_experts = w13.shape[0]
    flat = topk_ids.flatten().long()
    valid = (flat >= 0) & (flat < num_experts)
    hit = torch.unique(flat[valid])  # only these are dequantized
    remap = torch.full((num_experts,), -1, dtype=torch.long, device=flat.device)
    remap[hit] = torch.arange(hit.numel(), device=flat.device)
    ids = torch.where(valid, remap[flat.clamp(0, num_experts - 1)], -1).view(topk_ids.shape).to(torch.int32)
    dtype = hidden.dtype
    w13_d = dequantize_mxfp4(w13[hit], w13_scale[hit], dtype)
    w2_d = dequantize_mxfp4(w2[hit], w2_scale[hit], dtype)
    b13 = None if w13_bias is None else w13_bias[hit].to(dtype)
    b2 = None if w2_bias is None else w2_bias[hit].to(dtype)
    return moe_ref.fused_moe(hidden, w13_d, w2_d, topk_weights, ids, activation=activation, w13_bias=b13,
                             w2_bias=b2, swiglu_limit=swiglu_limit)


def mxfp4_expert_params_mapping(experts_prefix: str = "experts") -> list[tuple[str, str, None, None]]:
    """Loader rules (param, checkpoint name, expert id, shard id), as `make_expert_params_mapping`'s,
    for the GPT-OSS MXFP4 checkpoint names: every expert at once (expert id None); the parameters'
    own loaders de-interleave gate/up and take this rank's slice."""
    p = experts_prefix
    return [(f"{p}.w13_weight", f"{p}.gate_up_proj_blocks", None, None),
            (f"{p}.w13_weight_scale", f"{p}.gate_up_proj_scales", None, None),
            (f"{p}.w13_bias", f"{p}.gate_up_proj_bias", None, None),
            (f"{p}.w2_weight", f"{p}.down_proj_blocks", None, None),
            (f"{p}.w2_weight_scale", f"{p}.down_proj_scales", None, None),
            (f"{p}.w2_bias", f"{p}.down_proj_bias", None, None)]


Part = Literal["blocks", "scales", "bias"]


class Mxfp4MoEMethod(QuantMethod):
    """MXFP4 experts (see the module docstring for the layout). Loads only the stacked GPT-OSS
    tensors (experts.gate_up_proj_blocks ...), through `mxfp4_expert_params_mapping`."""

    def create_weights(self, layer: nn.Module, *, num_experts: int, hidden_size: int, intermediate_size: int,
                       weight_loader=None, has_bias: bool = False, params_dtype: torch.dtype | None = None) -> None:
        prefix = getattr(layer, "prefix", "")
        if hidden_size % MXFP4_BLOCK:
            raise ValueError(f"{prefix}: MXFP4 experts need hidden_size a multiple of {MXFP4_BLOCK}, got {hidden_size}")
        if intermediate_size % MXFP4_BLOCK:
            tp = getattr(layer, "tp_size", 1)
            raise ValueError(f"{prefix}: MXFP4 experts need the intermediate size per rank to be a multiple of "
                             f"{MXFP4_BLOCK} (whole scale groups), got {intermediate_size} (tensor-parallel size "
                             f"{tp}); use enable_expert_parallel or a tensor-parallel size that keeps groups whole")
        e, h, i = num_experts, hidden_size, intermediate_size
        shapes = {"w13": (2 * i, h), "w2": (h, i)}
        for name, (rows, cols) in shapes.items():
            blocks = nn.Parameter(torch.empty(e, rows, cols // 2, dtype=torch.uint8), requires_grad=False)
            scales = nn.Parameter(torch.empty(e, rows, cols // MXFP4_BLOCK, dtype=SCALE_DTYPE), requires_grad=False)
            set_weight_attrs(blocks, weight_loader=self._loader(layer, name, "blocks"))
            set_weight_attrs(scales, weight_loader=self._loader(layer, name, "scales"))
            layer.register_parameter(f"{name}_weight", blocks)
            layer.register_parameter(f"{name}_weight_scale", scales)
            if has_bias:
                bias = nn.Parameter(torch.empty(e, rows, dtype=params_dtype), requires_grad=False)
                set_weight_attrs(bias, weight_loader=self._loader(layer, name, "bias"))
                layer.register_parameter(f"{name}_bias", bias)

    @staticmethod
    def _loader(layer: nn.Module, name: str, part: Part):
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None, expert_id=None) -> None:
            if expert_id is not None or shard_id is not None:
                raise ValueError(f"{layer.prefix}: MXFP4 experts load from the stacked checkpoint tensors "
                                 f"(experts.gate_up_proj_blocks ...), not per expert ({shard_id!r}, {expert_id!r})")
            src = _rank_part(layer, name, part, loaded, param.shape)
            dst = param.data
            if part == "bias":
                if src.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                    raise ValueError(f"{layer.prefix}.{name}_bias: expected a float bias, got {src.dtype}")
                dst.copy_(src)
            else:
                _bytes(dst).copy_(_bytes(src).reshape(dst.shape))

        return load

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              activation: str = "silu", swiglu_limit: float | None = None) -> torch.Tensor:
        if x.is_cuda:
            from atom_core.kernels.triton.moe_mxfp4 import fused_moe_mxfp4 as moe
        else:
            moe = fused_moe_mxfp4_ref
        return moe(x, layer.w13_weight, layer.w13_weight_scale.view(torch.uint8), layer.w2_weight,
                   layer.w2_weight_scale.view(torch.uint8), topk_weights, topk_ids, activation=activation,
                   w13_bias=getattr(layer, "w13_bias", None), w2_bias=getattr(layer, "w2_bias", None),
                   swiglu_limit=swiglu_limit)


def _rank_part(layer: nn.Module, name: str, part: Part, loaded: torch.Tensor,
               param_shape: torch.Size) -> torch.Tensor:
    """This rank's part of a stacked checkpoint tensor, in our layout: its experts (EP), gate/up
    de-interleaved (w13), and its slice of the intermediate dim (TP: w13 rows, w2 32-groups)."""
    use_ep, tp, rank = layer.use_ep, layer.tp_size, layer.tp_rank
    e_local = layer.num_local_experts
    if part == "blocks":  # [E, R, G, 16] (or [E, R, G*16])
        loaded = _bytes(loaded)
        loaded = loaded.reshape(*loaded.shape[:2], -1, MXFP4_BLOCK // 2)
    elif part == "scales":
        loaded = _bytes(loaded)
    rows, cols = param_shape[1], (param_shape[2] if len(param_shape) > 2 else None)
    full_experts = layer.num_experts
    tp_split = tp if (tp > 1 and not use_ep) else 1
    groups = None if cols is None else (cols * 2 if part == "blocks" else cols * MXFP4_BLOCK) // MXFP4_BLOCK
    if name == "w13":
        expected = (full_experts, rows * tp_split) + (() if groups is None else (groups,))
    else:
        expected = (full_experts, rows) + (() if groups is None else (groups * tp_split,))
    if tuple(loaded.shape[:len(expected)]) != expected:
        raise ValueError(f"{layer.prefix}: checkpoint MXFP4 {name} {part} has shape {tuple(loaded.shape)}; expected "
                         f"{list(expected)}{' x 16 bytes' if part == 'blocks' else ''} for this model")
    if use_ep:
        loaded = loaded.narrow(0, layer.expert_start, e_local)
    if name == "w13":
        gate, up = loaded[:, 0::2], loaded[:, 1::2]
        if tp_split > 1:
            half = rows // 2
            gate, up = gate.narrow(1, rank * half, half), up.narrow(1, rank * half, half)
        return torch.cat([gate, up], dim=1)
    if part == "bias":
        return loaded if rank == 0 or tp_split == 1 else torch.zeros_like(loaded)  # added once after the all-reduce
    if tp_split > 1:
        loaded = loaded.narrow(2, rank * groups, groups)
    return loaded


class Mxfp4Config(QuantConfig):
    name = "mxfp4"

    def __init__(self, not_converted: list[str]):
        self.not_converted = not_converted

    @classmethod
    def from_config(cls, qc: dict) -> "Mxfp4Config":
        entries = qc.get("modules_to_not_convert") or []
        if not isinstance(entries, (list, tuple)) or not all(isinstance(x, str) for x in entries):
            raise ValueError(f"mxfp4 modules_to_not_convert must be a list of module names, got {entries!r}")
        return cls(list(entries))

    def describe(self) -> str:
        return "mxfp4 (e2m1 MoE experts, e8m0 scales per 32 values; other layers unquantized)"

    def is_converted(self, name: str) -> bool:
        """HF's `should_convert_module`: an entry (a regex) skips the module when it matches from the
        start up to a dotted boundary ("model.layers.*.self_attn"), or is a suffix of its name."""
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        return not any(re.match(rf"(?:{key}){boundary}", name) or name.endswith(key) for key in self.not_converted)

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantMethod | None:
        if isinstance(layer, MoELayer) and self.is_converted(prefix):
            return Mxfp4MoEMethod()
        return None  # MXFP4 checkpoints quantize only MoE experts (see the module docstring)
