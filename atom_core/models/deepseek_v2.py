"""DeepSeek-V2 / V2-Lite (DeepseekV2ForCausalLM), DeepSeek-V3 / R1 and Kimi-K2
(DeepseekV3ForCausalLM): multi-head latent attention over a latent KV cache (model_ops/mla.py),
YaRN rope with mscale, interleaved rope pairs, the first `first_k_dense_replace` layers dense and
the rest routed experts plus shared experts.

Routing: V2 "greedy" (softmax top-k) or "group_limited_greedy" (softmax, best groups by max),
never renormalised; V3 "noaux_tc" (sigmoid + correction bias, groups by top-2 sum, renormalised
iff norm_topk_prob); both times routed_scaling_factor.

The checkpoint's MTP layer (model.layers.{num_hidden_layers}) is skipped here (DecoderForCausalLM);
with `--method mtp`, spec_decode/mtp.py builds it from `layer_cls` (a layer index >=
first_k_dense_replace gets the MoE block) and feeds it the final hidden states this model returns.
"""
from __future__ import annotations

import functools
import json
import math

import torch
from torch import nn

from atom_core.model_ops.layernorm import RMSNorm
from atom_core.model_ops.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from atom_core.model_ops.mla import MLAAttention
from atom_core.model_ops.moe import MoERouting, SparseMoeBlock, make_expert_params_mapping
from atom_core.model_ops.rotary import RotaryEmbedding, rope_parameters
from atom_core.models.common import DecoderForCausalLM, DecoderLayer, GatedMLP, layer_index
from atom_core.quant import QuantConfig

LORA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: HF builds them with the default eps


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_softmax_scale(config) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (HF yarn_apply_mscale)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    _, scaling = rope_parameters(config)
    if scaling is not None and scaling.get("mscale_all_dim"):
        scale *= _yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return scale


@functools.lru_cache(maxsize=8)
def _rotary(rope_dim: int, max_position: int, theta: float, scaling_json: str, device: str) -> RotaryEmbedding:
    scaling = json.loads(scaling_json)
    return RotaryEmbedding(rope_dim, rope_dim, max_position, theta, scaling)


def shared_rotary(config) -> RotaryEmbedding:
    """One cos/sin cache for every layer (V3's is 163840 positions: 40 MB each otherwise)."""
    theta, scaling = rope_parameters(config)
    return _rotary(config.qk_rope_head_dim, config.max_position_embeddings, theta,
                   json.dumps(scaling, sort_keys=True), str(torch.get_default_device()))


# Families whose HF config has no topk_method field: their routing is always V3's.
NOAUX_TC_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM",
                          "KimiK25ForConditionalGeneration", "Kimi_K25ForConditionalGeneration")


def deepseek_routing(config) -> MoERouting:
    method = getattr(config, "topk_method", None)
    common = dict(top_k=config.num_experts_per_tok, routed_scaling_factor=config.routed_scaling_factor,
                  router_in_fp32=True)
    if method == "noaux_tc" or set(NOAUX_TC_ARCHITECTURES) & set(getattr(config, "architectures", None) or []):
        if method not in (None, "noaux_tc"):
            raise ValueError(f"DeepseekV3 topk_method {method!r} is not supported; expected noaux_tc")
        return MoERouting(scoring="sigmoid", renormalize=bool(config.norm_topk_prob), correction_bias=True,
                          num_expert_group=config.n_group, topk_group=config.topk_group, **common)
    if method == "greedy":
        return MoERouting(scoring="softmax", **common)
    if method == "group_limited_greedy":
        return MoERouting(scoring="softmax", num_expert_group=config.n_group, topk_group=config.topk_group, **common)
    raise ValueError(f"DeepseekV2 topk_method {method!r} is not supported; expected one of: greedy, "
                     "group_limited_greedy")


class DeepseekV2Attention(nn.Module):
    """q (plain q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj), kv_a_proj_with_mqa -> latent +
    rope key, MLA over the latent cache (which applies kv_a_layernorm to the latent, fused with
    RoPE and the cache store), o_proj.

    Heads: q_b_proj / kv_b_proj are column-parallel over heads and o_proj row-parallel, so this
    rank's head count is read from kv_b_proj's output size (`num_local_heads`), in one place."""

    def __init__(self, config, prefix: str, quant_config: QuantConfig | None = None):
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        nope, rope, v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_head_dim = nope + rope
        bias = getattr(config, "attention_bias", False)
        self.q_lora_rank = config.q_lora_rank
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, heads * self.qk_head_dim, quant_config=quant_config,
                                               prefix=f"{prefix}.q_proj")
        else:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias=bias, quant_config=quant_config,
                                             prefix=f"{prefix}.q_a_proj")
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * self.qk_head_dim, quant_config=quant_config,
                                                 prefix=f"{prefix}.q_b_proj")
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + rope, bias=bias,
                                                   quant_config=quant_config, prefix=f"{prefix}.kv_a_proj_with_mqa")
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, heads * (nope + v_dim), quant_config=quant_config,
                                              prefix=f"{prefix}.kv_b_proj")
        self.num_local_heads = self.kv_b_proj.output_sizes[0] // (nope + v_dim)
        self.o_proj = RowParallelLinear(heads * v_dim, hidden, bias=bias, quant_config=quant_config,
                                        prefix=f"{prefix}.o_proj")
        self.rotary_emb = shared_rotary(config)
        self.mla_attn = self.make_mla(config, prefix)

    def make_mla(self, config, prefix: str) -> MLAAttention:
        """The attention over the latent cache (a sparse-attention family returns its own)."""
        interleaved = getattr(config, "rope_interleave", True)  # V2 always pairs; V3 says so
        return MLAAttention(self.num_local_heads, config.qk_nope_head_dim, config.qk_rope_head_dim,
                            config.v_head_dim, self.kv_lora_rank, mla_softmax_scale(config), self.rotary_emb,
                            self.kv_a_layernorm, self.kv_b_proj, interleaved, prefix=f"{prefix}.mla_attn")

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        kv_a = self.kv_a_proj_with_mqa(hidden)  # [T, C + R]: mla_attn normalises the latent and ropes k_pe
        q = q.view(-1, self.num_local_heads, self.qk_head_dim)
        return self.o_proj(self.mla_attn(q, kv_a, positions))


class DeepseekV2DecoderLayer(DecoderLayer):
    """Pre-norm MLA + (dense MLP for layer < first_k_dense_replace, else routed + shared experts).
    The layer index comes from the prefix ("model.layers.3"), so an MTP block can build one."""

    attention_cls = DeepseekV2Attention

    def __init__(self, config, prefix: str, quant_config: QuantConfig | None = None):
        mlp_prefix = f"{prefix}.mlp"
        if layer_index(prefix) < config.first_k_dense_replace:
            mlp = GatedMLP(config.hidden_size, config.intermediate_size, mlp_prefix, quant_config,
                           hidden_act=config.hidden_act)
        else:
            shared = None
            if config.n_shared_experts:
                shared = GatedMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts,
                                  f"{mlp_prefix}.shared_experts", quant_config, hidden_act=config.hidden_act)
            mlp = SparseMoeBlock(config.hidden_size, config.n_routed_experts, config.moe_intermediate_size,
                                 deepseek_routing(config), mlp_prefix, quant_config, shared_experts=shared)
        super().__init__(config, self.attention_cls(config, f"{prefix}.self_attn", quant_config), mlp)


class DeepseekV2ForCausalLM(DecoderForCausalLM):
    layer_cls = DeepseekV2DecoderLayer
    # q_proj is its own layer here (not a QKV shard): only the MLPs pack checkpoint modules.
    stacked_params_mapping = [("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]

    def __init__(self, config, prefix: str = "", quant_config: QuantConfig | None = None):
        if getattr(config, "kv_lora_rank", None) is None:
            raise ValueError("DeepSeek-V2/V3 configs need kv_lora_rank (MLA); this config has none")
        super().__init__(config, prefix, quant_config)
        self.expert_params_mapping = make_expert_params_mapping(config.n_routed_experts, "gate_proj", "down_proj",
                                                                "up_proj")


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """Same modules; the routing (noaux_tc) is chosen from the architecture name in the config."""
