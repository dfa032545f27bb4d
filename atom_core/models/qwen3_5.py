"""Qwen3.5 text models (Qwen3_5ForCausalLM dense, Qwen3_5MoeForCausalLM): Qwen3-Next's hybrid stack
(models/qwen3_next.py) with the DeltaNet inputs from four plain projections (in_proj_qkv: q | k | v, in_proj_z,
in_proj_b, in_proj_a); the dense model's every MLP is dense, the MoE model's every MLP routed (renormalised
top-k) plus the gated shared expert. HF's multimodal RoPE gets equal text/height/width positions from text
alone, which is plain RoPE on the first partial_rotary_factor of each head, as here.

The published checkpoints are vision-language models (Qwen3_5ForConditionalGeneration,
Qwen3_5MoeForConditionalGeneration): their `text_config` is this text model's config (loader/model_dir.py),
its weights sit under model.language_model.*, and the vision tower's (model.visual.*) are skipped: text in,
text out; the API refuses image parts."""
from __future__ import annotations

import torch
from torch import nn

from atom_core.model_ops.linear import ColumnParallelLinear
from atom_core.model_ops.linear_attention import ConcatColumnParallelLinear, GatedDeltaNet
from atom_core.models.common import GatedMLP
from atom_core.models.qwen3_next import HybridDecoderLayer, HybridForCausalLM, SharedExpertMoe, hybrid_routing
from atom_core.quant import QuantConfig


class Qwen3_5GatedDeltaNet(GatedDeltaNet):
    def __init__(self, config, prefix: str, quant_config: QuantConfig | None):
        super().__init__(config, prefix, quant_config)
        hidden = config.hidden_size
        key = config.linear_num_key_heads * self.head_k_dim
        value = config.linear_num_value_heads * self.head_v_dim
        self.in_proj_qkv = ConcatColumnParallelLinear(hidden, [key, key, value], quant_config=quant_config,
                                                      prefix=f"{prefix}.in_proj_qkv")
        self.in_proj_z = ColumnParallelLinear(hidden, value, quant_config=quant_config, prefix=f"{prefix}.in_proj_z")
        self.in_proj_b = ColumnParallelLinear(hidden, config.linear_num_value_heads, quant_config=quant_config,
                                              prefix=f"{prefix}.in_proj_b")
        self.in_proj_a = ColumnParallelLinear(hidden, config.linear_num_value_heads, quant_config=quant_config,
                                              prefix=f"{prefix}.in_proj_a")

    def project(self, hidden: torch.Tensor):
        z = self.in_proj_z(hidden).view(hidden.shape[0], self.num_v_heads, self.head_v_dim)
        return self.in_proj_qkv(hidden), z, self.in_proj_b(hidden), self.in_proj_a(hidden)


class Qwen3_5DecoderLayer(HybridDecoderLayer):
    linear_attn_cls = Qwen3_5GatedDeltaNet

    def make_mlp(self, config, prefix: str, quant_config: QuantConfig | None) -> nn.Module:
        return GatedMLP(config.hidden_size, config.intermediate_size, prefix, quant_config,
                        hidden_act=config.hidden_act)


class Qwen3_5MoeDecoderLayer(HybridDecoderLayer):
    linear_attn_cls = Qwen3_5GatedDeltaNet

    def make_mlp(self, config, prefix: str, quant_config: QuantConfig | None) -> nn.Module:
        return SharedExpertMoe(config, prefix, quant_config, hybrid_routing(config, renormalize=True))


class Qwen3_5ForCausalLM(HybridForCausalLM):
    layer_cls = Qwen3_5DecoderLayer


class Qwen3_5MoeForCausalLM(HybridForCausalLM):
    layer_cls = Qwen3_5MoeDecoderLayer


class _TextOfVisionLanguage:
    """The text model of a vision-language checkpoint: model.language_model.* is our model.*; the vision
    tower's model.visual.* tensors have no parameter here."""

    def checkpoint_name(self, name: str) -> str:
        return "model." + name[len("model.language_model."):] if name.startswith("model.language_model.") else name

    def skip_checkpoint_weight(self, name: str) -> bool:
        return name.startswith("model.visual.") or super().skip_checkpoint_weight(name)


class Qwen3_5ForConditionalGeneration(_TextOfVisionLanguage, Qwen3_5ForCausalLM):
    pass


class Qwen3_5MoeForConditionalGeneration(_TextOfVisionLanguage, Qwen3_5MoeForCausalLM):
    pass
