"""Qwen3-MoE: Qwen3 attention (q/k-norm); each layer's MLP is routed experts (softmax top-k,
renormalised iff norm_topk_prob) unless it is in mlp_only_layers or off the decoder_sparse_step."""
from __future__ import annotations

from atom_core.model_ops.moe import MoERouting, SparseMoeBlock, make_expert_params_mapping
from atom_core.models.common import DecoderForCausalLM, DecoderLayer, GatedMLP, SelfAttention, layer_index
from atom_core.models.qwen3 import qwen3_attention_options
from atom_core.quant import QuantConfig


def is_sparse_layer(config, layer_idx: int) -> bool:
    return (layer_idx not in (config.mlp_only_layers or []) and config.num_experts > 0
            and (layer_idx + 1) % config.decoder_sparse_step == 0)


class Qwen3MoeDecoderLayer(DecoderLayer):
    def __init__(self, config, prefix: str, quant_config: QuantConfig | None = None):
        idx = layer_index(prefix)
        if is_sparse_layer(config, idx):
            # HF casts the routing weights to the model dtype before weighing the experts.
            routing = MoERouting(top_k=config.num_experts_per_tok, renormalize=config.norm_topk_prob,
                                 weights_in_model_dtype=True)
            mlp = SparseMoeBlock(config.hidden_size, config.num_experts, config.moe_intermediate_size, routing,
                                 f"{prefix}.mlp", quant_config)
        else:
            mlp = GatedMLP(config.hidden_size, config.intermediate_size, f"{prefix}.mlp", quant_config,
                           hidden_act=config.hidden_act)
        attn = SelfAttention(config, f"{prefix}.self_attn", quant_config, qwen3_attention_options(config, idx))
        super().__init__(config, attn, mlp)


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer

    def __init__(self, config, prefix: str = "", quant_config: QuantConfig | None = None):
        super().__init__(config, prefix, quant_config)
        self.expert_params_mapping = make_expert_params_mapping(config.num_experts, "gate_proj", "down_proj",
                                                                "up_proj")
