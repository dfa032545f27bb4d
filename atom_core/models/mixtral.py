"""Mixtral: Llama/Mistral attention; every layer's MLP (`block_sparse_moe`, as the checkpoints
name it) is routed experts w1 (gate) / w3 (up) / w2 (down), softmax top-k renormalised."""
from __future__ import annotations

from atom_core.model_ops.moe import MoERouting, SparseMoeBlock, make_expert_params_mapping
from atom_core.models.common import (
    AttentionOptions, DecoderForCausalLM, DecoderLayer, SelfAttention, layer_index, sliding_window_of,
)
from atom_core.quant import QuantConfig


class MixtralDecoderLayer(DecoderLayer):
    mlp_name = "block_sparse_moe"

    def __init__(self, config, prefix: str, quant_config: QuantConfig | None = None):
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; expected silu")
        options = AttentionOptions(sliding_window=sliding_window_of(config, layer_index(prefix)))
        routing = MoERouting(top_k=config.num_experts_per_tok, renormalize=True)
        super().__init__(
            config,
            SelfAttention(config, f"{prefix}.self_attn", quant_config, options),
            SparseMoeBlock(config.hidden_size, config.num_local_experts, config.intermediate_size, routing,
                           f"{prefix}.{self.mlp_name}", quant_config),
        )


class MixtralForCausalLM(DecoderForCausalLM):
    layer_cls = MixtralDecoderLayer

    def __init__(self, config, prefix: str = "", quant_config: QuantConfig | None = None):
        super().__init__(config, prefix, quant_config)
        self.expert_params_mapping = make_expert_params_mapping(config.num_local_experts, "w1", "w2", "w3")
