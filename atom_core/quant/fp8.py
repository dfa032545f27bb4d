"""FP8 (`quant_method: fp8`), two ways:

Block FP8 checkpoints (DeepSeek-V3/R1, Qwen3-*-FP8; HF's FineGrainedFP8 layout):
  quantization_config {"quant_method": "fp8", "activation_scheme": "dynamic",
                       "weight_block_size": [bn, bk], "modules_to_not_convert"/"ignored_layers": [...]}
  each quantized Linear stores `weight` float8_e4m3fn [N, K] and `weight_scale_inv` float32
  [ceil(N/bn), ceil(K/bk)] (a multiplier, see fp8_ops). Activations are quantized per token per
  bk columns on the fly. On load the block scale is expanded to one row per output row,
  [N, ceil(K/bk)], so packed shards (q/k/v, gate/up) and tensor-parallel slices of any size
  (including ones that are not multiples of bn) place exactly like weight rows; the product
  runs `fp8_block_linear` with block [1, bk].

Online FP8 (`--quantization fp8` on a bf16/fp16 checkpoint, as in vLLM): weights load in the
  model dtype and are quantized after loading to e4m3 with one float32 scale per output
  channel; activations get a dynamic per-token scale; the product is `fp8_linear`
  (torch._scaled_mm on CUDA). Loading holds the model-dtype weights until they are quantized.

Block-FP8 MoE experts (FusedMoE): on CUDA the fused Triton kernel (kernels/triton/moe_fp8.py,
e4m3 MMAs with the scales applied per 128 columns), elsewhere `fused_moe_fp8_block_ref`, a per-expert loop of the block product. Not here
yet: online FP8 for MoE experts and static activation scales (activation_scheme "static"): both
fail at start with a message.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from atom_core.kernels.moe_ref import apply_activation, check_activation
from atom_core.quant.base import MoELayer, QuantConfig, QuantMethod, set_weight_attrs
from atom_core.quant.fp8_ops import (
    FP8_DTYPE, fp8_block_linear, fp8_block_linear_ref, fp8_block_linear_table, fp8_linear, fp8_linear_table,
    quantize_fp8_per_token,
)

PACKED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class Fp8BlockLinearMethod(QuantMethod):
    """weight e4m3 [N, K]; weight_scale_inv float32 [N, ceil(K/bk)] (block scales expanded by row at load)."""

    def __init__(self, block_size: tuple[int, int]):
        self.block_n, self.block_k = block_size

    def create_weights(self, layer: nn.Module, *, input_size: int, output_sizes: list[int], weight_loader,
                       params_dtype: torch.dtype | None = None) -> None:
        n, bk = sum(output_sizes), self.block_k
        if getattr(layer, "tp_dim", None) == 1 and getattr(layer, "tp_size", 1) > 1 and input_size % bk:
            raise ValueError(f"{getattr(layer, 'prefix', '')}: block-FP8 input size per rank {input_size} is not a "
                             f"multiple of the weight block {bk}; use a tensor-parallel size that keeps K blocks whole")
        weight = nn.Parameter(torch.empty(n, input_size, dtype=FP8_DTYPE), requires_grad=False)
        set_weight_attrs(weight, weight_loader=weight_loader, output_dim=0, input_dim=1)
        scale = nn.Parameter(torch.empty(n, -(-input_size // bk), dtype=torch.float32), requires_grad=False)
        set_weight_attrs(scale, weight_loader=self._scale_loader(layer, weight_loader), output_dim=0, input_dim=1)
        layer.register_parameter("weight", weight)
        layer.register_parameter("weight_scale_inv", scale)
        layer.kernel_table = fp8_block_linear_table(weight.device, torch.get_default_dtype(), [1, bk])

    def _scale_loader(self, layer: nn.Module, weight_loader):
        bn = self.block_n

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
            """Checkpoint block scales [ceil(R/bn), kb] -> one row per weight row, then the layer's loader."""
            rows = loaded.float().repeat_interleave(bn, 0)
            tp = layer.tp_size if getattr(layer, "tp_dim", None) == 0 else 1
            if shard_id is None:
                full = param.shape[0] * tp
            else:
                index = {"q": 0, "k": 1, "v": 2}.get(shard_id, shard_id)
                full = layer.output_sizes[index] * tp
            weight_loader(param, rows[:min(full, rows.shape[0])], shard_id)

        return load

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return fp8_block_linear(x, layer.weight, layer.weight_scale_inv, [1, self.block_k], bias,
                                layer.kernel_table.key)


class Fp8BlockMoEMethod(QuantMethod):
    """Block-FP8 experts: w13_weight e4m3 [E, 2I, H] + w13_weight_scale_inv float32 [E, 2I, ceil(H/bk)],
    w2_weight e4m3 [E, H, I] + w2_weight_scale_inv [E, H, ceil(I/bk)] (block scales expanded by row
    at load, as for the linear method: TP slices and the gate/up halves place like weight rows, and
    the fused kernel reads the row-expanded scales as they are). The product: the fused Triton
    kernel on CUDA, `fused_moe_fp8_block_ref` elsewhere."""

    def __init__(self, block_size: tuple[int, int]):
        self.block_n, self.block_k = block_size

    def create_weights(self, layer: nn.Module, *, num_experts: int, hidden_size: int, intermediate_size: int,
                       weight_loader, has_bias: bool = False, params_dtype: torch.dtype | None = None) -> None:
        if has_bias:
            raise ValueError(f"{layer.prefix}: block-FP8 experts with biases (e.g. GPT-OSS) are not supported")
        bk = self.block_k
        if getattr(layer, "tp_size", 1) > 1 and not getattr(layer, "use_ep", False) and intermediate_size % bk:
            raise ValueError(f"{layer.prefix}: block-FP8 expert intermediate size per rank {intermediate_size} is "
                             f"not a multiple of the weight block {bk}; use expert parallelism or another "
                             f"tensor-parallel size")
        shapes = {"w13": (2 * intermediate_size, hidden_size), "w2": (hidden_size, intermediate_size)}
        experts = range(layer.expert_start, layer.expert_start + num_experts)
        for name, (rows, cols) in shapes.items():
            weight = nn.Parameter(torch.empty(num_experts, rows, cols, dtype=FP8_DTYPE), requires_grad=False)
            set_weight_attrs(weight, weight_loader=weight_loader)
            scale = nn.Parameter(torch.empty(num_experts, rows, -(-cols // bk), dtype=torch.float32),
                                 requires_grad=False)
            set_weight_attrs(scale, weight_loader=self._scale_loader(layer, weight_loader, intermediate_size))
            shards = ("w1", "w3") if name == "w13" else ("w2",)
            scale.expected_shards = frozenset((s, e) for e in experts for s in shards)
            layer.register_parameter(f"{name}_weight", weight)
            layer.register_parameter(f"{name}_weight_scale_inv", scale)

    def _scale_loader(self, layer: nn.Module, weight_loader, intermediate_size: int):
        bn = self.block_n

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None, expert_id=None) -> None:
            if expert_id is None:
                raise ValueError(f"{layer.prefix}: block-FP8 experts load per expert (experts.N.*.weight_scale_inv)")
            tp = 1 if layer.use_ep else layer.tp_size
            full = param.shape[1] if shard_id == "w2" else intermediate_size * tp  # checkpoint rows of this shard
            rows = loaded.float().repeat_interleave(bn, 0)
            weight_loader(param, rows[:min(full, rows.shape[0])], shard_id, expert_id)

        return load

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              activation: str = "silu", swiglu_limit: float | None = None) -> torch.Tensor:
        if x.is_cuda:
            from atom_core.kernels.triton.moe_fp8 import fused_moe_fp8_block as moe
        else:
            moe = fused_moe_fp8_block_ref
        return moe(x, layer.w13_weight, layer.w13_weight_scale_inv, layer.w2_weight, layer.w2_weight_scale_inv,
                   topk_weights, topk_ids, self.block_k, activation, swiglu_limit)


def fused_moe_fp8_block_ref(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H] e4m3: gate rows then up rows
    w13_scale: torch.Tensor,  # [E, 2I, ceil(H/G)] float32, one row per weight row
    w2: torch.Tensor,  # [E, H, I] e4m3
    w2_scale: torch.Tensor,  # [E, H, ceil(I/G)] float32
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int
    group_size: int = 128,
    activation: str = "silu",
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """The block-FP8 experts in plain PyTorch (the CPU path; oracle of kernels/triton/moe_fp8.py):
    out[t] = sum_k w[t, k] * down(act(gate_up(x_t))) with each product `fp8_block_linear_ref`
    (input quantized per token per G columns, row-expanded block scales, float32 accumulation,
    the result rounded to hidden's dtype), act = moe_ref.apply_activation in hidden's dtype, the
    weighted sum over the K experts in float32, cast once. Ids outside [0, E) are dropped."""
    check_activation(activation, swiglu_limit)
    block = [1, group_size]
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    flat, flat_w = topk_ids.flatten().long(), topk_weights.flatten().float()
    for e in torch.unique(flat).tolist():
        if not 0 <= e < w13.shape[0]:
            continue
        slots = (flat == e).nonzero().squeeze(1)
        tokens = slots // top_k
        h = fp8_block_linear_ref(hidden.index_select(0, tokens), w13[e], w13_scale[e], block)
        y = fp8_block_linear_ref(apply_activation(h, activation, swiglu_limit), w2[e], w2_scale[e], block)
        out.index_add_(0, tokens, y.float() * flat_w[slots, None])
    return out.to(hidden.dtype)


class Fp8OnlineLinearMethod(QuantMethod):
    """Loads a model-dtype weight [N, K]; after loading: e4m3 weight + float32 weight_scale [N, 1]."""

    def create_weights(self, layer: nn.Module, *, input_size: int, output_sizes: list[int], weight_loader,
                       params_dtype: torch.dtype | None = None) -> None:
        weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=params_dtype), requires_grad=False)
        set_weight_attrs(weight, weight_loader=weight_loader, output_dim=0, input_dim=1)
        layer.register_parameter("weight", weight)
        layer.kernel_table = fp8_linear_table(weight.device, *weight.shape, weight.dtype, False)  # x: its dtype

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.weight.dtype == FP8_DTYPE:
            return
        q, scale = quantize_fp8_per_token(layer.weight.data)  # one row per output channel
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return fp8_linear(x, layer.weight, layer.weight_scale, None, bias, layer.kernel_table.key)


class Fp8ScaledLinearMethod(QuantMethod):
    """FP8 weights with checkpoint scales (compressed-tensors `float-quantized`: llm-compressor's
    FP8_DYNAMIC and FP8 schemes). weight e4m3 [N, K]; weight_scale float32 [N, 1]: a per-channel
    checkpoint scale loads as it is, a per-tensor one is repeated over its shard's rows, so fused
    q/k/v or gate/up with different scales run one row-wise product. Activations: dynamic per
    token, or static per tensor with input_scale [1] (the max over the fused shards; llm-compressor
    observes one input for q/k/v and one for gate/up, so their scales are equal)."""

    def __init__(self, per_tensor_weight: bool, static_input: bool):
        self.per_tensor_weight, self.static_input = per_tensor_weight, static_input

    def create_weights(self, layer: nn.Module, *, input_size: int, output_sizes: list[int], weight_loader,
                       params_dtype: torch.dtype | None = None) -> None:
        n = sum(output_sizes)
        weight = nn.Parameter(torch.empty(n, input_size, dtype=FP8_DTYPE), requires_grad=False)
        set_weight_attrs(weight, weight_loader=weight_loader, output_dim=0, input_dim=1)
        layer.register_parameter("weight", weight)
        scale = nn.Parameter(torch.empty(n, 1, dtype=torch.float32), requires_grad=False)
        loader = self._tensor_scale_loader(layer) if self.per_tensor_weight else weight_loader
        set_weight_attrs(scale, weight_loader=loader, output_dim=0)
        layer.register_parameter("weight_scale", scale)
        if self.static_input:
            input_scale = nn.Parameter(torch.zeros(1, dtype=torch.float32), requires_grad=False)
            set_weight_attrs(input_scale, weight_loader=self._input_scale_loader)
            layer.register_parameter("input_scale", input_scale)
        layer.kernel_table = fp8_linear_table(weight.device, n, input_size, torch.get_default_dtype(),
                                              self.static_input)

    @staticmethod
    def _tensor_scale_loader(layer: nn.Module):
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
            if loaded.numel() != 1:
                raise ValueError(f"{layer.prefix}: a per-tensor weight_scale must hold one value, got "
                                 f"{tuple(loaded.shape)}")
            if shard_id is None:
                param.data.fill_(float(loaded))
                return
            index = {"q": 0, "k": 1, "v": 2}.get(shard_id, shard_id)
            rows = layer.output_sizes[index] * getattr(layer, "tp_size", 1)  # the start row is not needed
            offset, size, _ = layer._shard_range(shard_id, rows)
            param.data.narrow(0, offset, size).fill_(float(loaded))

        return load

    @staticmethod
    def _input_scale_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.numel() != 1:
            raise ValueError(f"a static per-tensor input_scale must hold one value, got {tuple(loaded.shape)}")
        param.data.copy_(torch.maximum(param.data, loaded.float().reshape(1).to(param.device)))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return fp8_linear(x, layer.weight, layer.weight_scale, getattr(layer, "input_scale", None), bias,
                          layer.kernel_table.key)


class Fp8Config(QuantConfig):
    name = "fp8"

    def __init__(self, block_size: tuple[int, int] | None, ignored: list[str], online: bool):
        self.block_size, self.ignored, self.online = block_size, ignored, online

    @classmethod
    def from_config(cls, qc: dict) -> "Fp8Config":
        if not qc:  # --quantization fp8 on an unquantized checkpoint
            return cls(None, [], online=True)
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(f"fp8 activation_scheme {scheme!r} is not supported (only 'dynamic')")
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"fp8 fmt {fmt!r} is not supported (only 'e4m3')")
        block = qc.get("weight_block_size")
        if block is None:
            raise ValueError("fp8 checkpoints without weight_block_size (per-tensor fp8 serialization) are not "
                             "supported; block FP8 (weight_block_size [128, 128]) and online --quantization fp8 "
                             "on a bf16 checkpoint are")
        if len(block) != 2 or any(int(b) <= 0 for b in block):
            raise ValueError(f"fp8 weight_block_size must be two positive ints, got {block!r}")
        ignored = list(qc.get("modules_to_not_convert") or []) + list(qc.get("ignored_layers") or [])
        return cls((int(block[0]), int(block[1])), ignored, online=False)

    def describe(self) -> str:
        if self.online:
            return "fp8 online (e4m3 per-channel weights, dynamic per-token activations)"
        return f"fp8 block {self.block_size[0]}x{self.block_size[1]} (e4m3, dynamic per-token-group activations)"

    def _ignored(self, name: str) -> bool:
        """HF's rule (modules_to_not_convert): an entry matches when it is a dotted part of the name."""
        for entry in self.ignored:
            if entry.startswith("re:"):
                if re.match(entry[3:], name):
                    return True
            elif re.search(rf"(^|\.){re.escape(entry)}(\.|$)", name):
                return True
        return False

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantMethod | None:
        if isinstance(layer, MoELayer):
            if self._ignored(prefix):
                return None
            if self.online:
                raise ValueError(f"{prefix}: online FP8 MoE experts are not supported yet; --quantization fp8 "
                                 f"quantizes dense layers only, so use a block-FP8 checkpoint for MoE models")
            return Fp8BlockMoEMethod(self.block_size)
        if prefix.endswith("lm_head"):
            return None
        head, _, leaf = prefix.rpartition(".")
        names = [f"{head}.{m}" if head else m for m in PACKED_MODULES.get(leaf, (leaf,))]
        ignored = {self._ignored(n) for n in names}
        if len(ignored) > 1:
            raise ValueError(f"{prefix}: the modules fused into this layer are not all quantized "
                             f"(modules_to_not_convert names some of {names})")
        if ignored.pop():
            return None
        return Fp8OnlineLinearMethod() if self.online else Fp8BlockLinearMethod(self.block_size)
