"""Qwen3 dense: the Llama layout plus per-head RMSNorm on q and k before RoPE."""
from __future__ import annotations

from atom_core.models.common import (
    AttentionOptions, DecoderForCausalLM, DecoderLayer, GatedMLP, SelfAttention, layer_index, sliding_window_of,
)
from atom_core.quant import QuantConfig


def qwen3_attention_options(config, layer_idx: int) -> AttentionOptions:
    bias = getattr(config, "attention_bias", False)  # HF: q, k, v and o_proj alike
    return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True,
                            sliding_window=sliding_window_of(config, layer_idx))


class Qwen3DecoderLayer(DecoderLayer):
    def __init__(self, config, prefix: str, quant_config: QuantConfig | None = None):
        super().__init__(
            config,
            SelfAttention(config, f"{prefix}.self_attn", quant_config,
                          qwen3_attention_options(config, layer_index(prefix))),
            GatedMLP(config.hidden_size, config.intermediate_size, f"{prefix}.mlp", quant_config,
                     hidden_act=config.hidden_act),
        )


class Qwen3ForCausalLM(DecoderForCausalLM):
    layer_cls = Qwen3DecoderLayer
