"""GLM-4.5 / GLM-4.5-Air (Glm4MoeForCausalLM): partial RoPE, q/k/v bias without o_proj bias,
optional q/k-norm; the first `first_k_dense_replace` layers dense, the rest routed experts with
sigmoid scores, a correction bias, grouped top-k and one shared expert block."""
from __future__ import annotations

from atom_core.model_ops.moe import MoERouting, SparseMoeBlock, make_expert_params_mapping
from atom_core.model_ops.rotary import partial_rotary_dim
from atom_core.models.common import (
    AttentionOptions, DecoderForCausalLM, DecoderLayer, GatedMLP, SelfAttention, head_dim_of, layer_index,
)
from atom_core.quant import QuantConfig


def glm4_moe_routing(config) -> MoERouting:
    return MoERouting(top_k=config.num_experts_per_tok, scoring="sigmoid", renormalize=config.norm_topk_prob,
                      correction_bias=True, num_expert_group=config.n_group, topk_group=config.topk_group,
                      routed_scaling_factor=config.routed_scaling_factor, router_in_fp32=True)


class Glm4MoeDecoderLayer(DecoderLayer):
    def __init__(self, config, prefix: str, quant_config: QuantConfig | None = None):
        options = AttentionOptions(qkv_bias=config.attention_bias, o_bias=False,
                                   qk_norm=getattr(config, "use_qk_norm", False),
                                   rotary_dim=partial_rotary_dim(config, head_dim_of(config)))
        mlp_prefix = f"{prefix}.mlp"
        if layer_index(prefix) < config.first_k_dense_replace:
            mlp = GatedMLP(config.hidden_size, config.intermediate_size, mlp_prefix, quant_config,
                           hidden_act=config.hidden_act)
        else:
            shared = GatedMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts,
                              f"{mlp_prefix}.shared_experts", quant_config, hidden_act=config.hidden_act)
            mlp = SparseMoeBlock(config.hidden_size, config.n_routed_experts, config.moe_intermediate_size,
                                 glm4_moe_routing(config), mlp_prefix, quant_config, shared_experts=shared)
        super().__init__(config, SelfAttention(config, f"{prefix}.self_attn", quant_config, options), mlp)


class Glm4MoeForCausalLM(DecoderForCausalLM):
    layer_cls = Glm4MoeDecoderLayer

    def __init__(self, config, prefix: str = "", quant_config: QuantConfig | None = None):
        if config.n_shared_experts < 1:
            raise ValueError(f"n_shared_experts={config.n_shared_experts}: GLM-4-MoE layers have a shared expert")
        super().__init__(config, prefix, quant_config)
        self.expert_params_mapping = make_expert_params_mapping(config.n_routed_experts, "gate_proj", "down_proj",
                                                                "up_proj")

    def skip_checkpoint_weight(self, name: str) -> bool:
        # The checkpoints carry the multi-token-prediction layer(s) after the last decoder
        # layer (model.layers.{num_hidden_layers}...); HF skips them too, and so do we until
        # speculative decoding uses them.
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and int(parts[2]) >= self.config.num_hidden_layers:
            return True
        return super().skip_checkpoint_weight(name)
