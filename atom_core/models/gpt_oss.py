"""GPT-OSS (GptOssForCausalLM: openai/gpt-oss-20b and -120b), as HF transformers' modeling_gpt_oss.

Attention: q/k/v/o with biases, one learned sink logit per head (it joins the softmax
denominator and carries no value), `layer_types` alternating sliding_attention (window
`sliding_window`) and full_attention, YaRN rope (neox) shared by every layer.
MoE in every layer: `router` (a linear with bias) picks the top-k logits and softmaxes over those k
(the same weights as a softmax over all experts renormalised on the chosen k); experts with
biases and the clamped SwiGLU "swigluoai" at `swiglu_limit`.

Checkpoints: bf16 ones hold HF's fused expert tensors `mlp.experts.gate_up_proj` [E, H, 2I] and
`down_proj` [E, I, H] (applied as x @ W) with `gate_up_proj_bias` [E, 2I] and `down_proj_bias`
[E, H]; the published ones hold the experts in MXFP4 (`gate_up_proj_blocks` / `_scales`, made by
quant/mxfp4.py from the config's quantization_config) with bf16 biases. Either way gate and up
alternate (gate = even rows/columns, up = odd); the experts' loaders de-interleave them into our
gate-rows-then-up-rows layout.
"""
from __future__ import annotations

import torch
from torch import nn

from atom_core.kernels.moe_ref import SWIGLU_ALPHA
from atom_core.model_ops.attention import Attention, QKTransform
from atom_core.model_ops.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from atom_core.model_ops.moe import FusedMoE, MoERouting
from atom_core.model_ops.rotary import rope_parameters, shared_rotary_embedding
from atom_core.models.common import DecoderForCausalLM, DecoderLayer, head_dim_of, layer_index, sliding_window_of
from atom_core.quant import QuantConfig
from atom_core.quant.mxfp4 import mxfp4_expert_params_mapping


def check_gpt_oss_config(config) -> None:
    """The values our kernels hard-wire; anything else is refused at construction."""
    alpha = getattr(config, "swiglu_alpha", SWIGLU_ALPHA)
    if abs(alpha - SWIGLU_ALPHA) > 1e-9:
        raise ValueError(f"GPT-OSS swiglu_alpha={alpha} is not supported; the MoE kernels use {SWIGLU_ALPHA}")
    layer_types = getattr(config, "layer_types", None) or []
    if len(layer_types) != config.num_hidden_layers or set(layer_types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"GPT-OSS layer_types must name each of the {config.num_hidden_layers} layers "
                         f"sliding_attention or full_attention, got {layer_types}")


class GptOssAttention(nn.Module):
    """qkv_proj (biased) -> RoPE, KV store, paged attention with this layer's window and sinks -> o_proj."""

    def __init__(self, config, prefix: str, layer_idx: int, quant_config: QuantConfig | None = None):
        super().__init__()
        head_dim = head_dim_of(config)
        bias = getattr(config, "attention_bias", True)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=bias, quant_config=quant_config,
                                          prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias=bias,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        theta, scaling = rope_parameters(config)
        self.rotary_emb = shared_rotary_embedding(head_dim, head_dim, config.max_position_embeddings, theta, scaling)
        self.attn = Attention(self.qkv_proj.num_heads, head_dim, head_dim**-0.5, self.qkv_proj.num_kv_heads,
                              QKTransform(self.rotary_emb), sliding_window=sliding_window_of(config, layer_idx),
                              prefix=f"{prefix}.attn", sinks=True)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attn(self.qkv_proj(hidden), positions))


class GptOssMoE(nn.Module):
    """`router` (linear with bias, unquantized in every GPT-OSS checkpoint) -> `experts` (FusedMoE)."""

    def __init__(self, config, prefix: str, quant_config: QuantConfig | None = None):
        super().__init__()
        num_experts, hidden = config.num_local_experts, config.hidden_size
        self.router = ReplicatedLinear(hidden, num_experts, bias=True, prefix=f"{prefix}.router")
        # HF softmaxes the chosen logits in the model dtype: the weights reach the experts rounded to it.
        routing = MoERouting(top_k=config.num_experts_per_tok, renormalize=True, weights_in_model_dtype=True)
        self.experts = FusedMoE(num_experts, hidden, config.intermediate_size, routing, f"{prefix}.experts",
                                quant_config, activation="swigluoai", swiglu_limit=float(config.swiglu_limit),
                                has_bias=True, gate_up_interleaved=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))


class GptOssDecoderLayer(DecoderLayer):
    def __init__(self, config, prefix: str, quant_config: QuantConfig | None = None):
        attn = GptOssAttention(config, f"{prefix}.self_attn", layer_index(prefix), quant_config)
        super().__init__(config, attn, GptOssMoE(config, f"{prefix}.mlp", quant_config))


def gpt_oss_expert_params_mapping() -> list[tuple[str, str, None, str | None]]:
    """Loader rules for the stacked expert tensors: bf16 (HF's [E, in, out] `gate_up_proj` /
    `down_proj`, hence "transposed") and MXFP4 (blocks / scales); the biases are common to both."""
    return [("experts.w13_weight", "experts.gate_up_proj", None, "transposed"),
            ("experts.w2_weight", "experts.down_proj", None, "transposed"),
            *mxfp4_expert_params_mapping("experts")]


class GptOssForCausalLM(DecoderForCausalLM):
    layer_cls = GptOssDecoderLayer
    # The checkpoint's `self_attn.sinks` belongs to the attention op (`self_attn.attn.sinks`).
    stacked_params_mapping = DecoderForCausalLM.stacked_params_mapping + [("self_attn.attn", "self_attn", None)]

    def __init__(self, config, prefix: str = "", quant_config: QuantConfig | None = None):
        check_gpt_oss_config(config)
        super().__init__(config, prefix, quant_config)
        self.expert_params_mapping = gpt_oss_expert_params_mapping()
