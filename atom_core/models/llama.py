"""Llama 2/3/3.1 (llama3 rope scaling) and Mistral (a global sliding window)."""
from __future__ import annotations

from atom_core.models.common import (
    AttentionOptions, DecoderForCausalLM, DecoderLayer, GatedMLP, SelfAttention, layer_index, sliding_window_of,
)
from atom_core.quant import QuantConfig


class LlamaDecoderLayer(DecoderLayer):
    def __init__(self, config, prefix: str, quant_config: QuantConfig | None = None):
        bias = getattr(config, "attention_bias", False)  # HF: q, k, v and o_proj alike
        options = AttentionOptions(qkv_bias=bias, o_bias=bias,
                                   sliding_window=sliding_window_of(config, layer_index(prefix)))
        super().__init__(
            config,
            SelfAttention(config, f"{prefix}.self_attn", quant_config, options),
            GatedMLP(config.hidden_size, config.intermediate_size, f"{prefix}.mlp", quant_config,
                     bias=getattr(config, "mlp_bias", False), hidden_act=getattr(config, "hidden_act", "silu")),
        )


class LlamaForCausalLM(DecoderForCausalLM):
    layer_cls = LlamaDecoderLayer
