"""Qwen3-Next (Qwen3NextForCausalLM): `layer_types` interleave gated DeltaNet linear-attention layers
(model_ops/linear_attention.py) with gated full attention (q_proj twice as wide: per head the query, then
a sigmoid gate on the attention output; q/k-norm; RoPE on the first partial_rotary_factor of each head);
every norm is zero-centred (HF scales by 1 + weight); MLPs are high-sparsity MoE (softmax top-k) with a
shared expert behind a sigmoid gate, or dense on mlp_only_layers. The target skips the MTP layer (`mtp.*`);
`--method mtp` loads it as its own module (Qwen3NextMTP below, through spec_decode/mtp.py)."""
from __future__ import annotations

import torch
from torch import nn

from atom_core.distributed.checks import check_head_split
from atom_core.distributed import get_tp_group
from atom_core.model_ops.attention import Attention, QKTransform
from atom_core.model_ops.layernorm import RMSNorm
from atom_core.model_ops.linear import (ColumnParallelLinear, LinearBase, QKVParallelLinear, ReplicatedLinear,
                                        RowParallelLinear, copy_weight)
from atom_core.model_ops.linear_attention import GatedDeltaNet
from atom_core.model_ops.moe import MoERouting, SparseMoeBlock, make_expert_params_mapping
from atom_core.model_ops.rotary import MRotaryEmbedding, RotaryEmbedding, partial_rotary_dim, rope_parameters
from atom_core.models.common import DecoderForCausalLM, GatedMLP, head_dim_of, layer_index
from atom_core.models.qwen3_moe import is_sparse_layer
from atom_core.quant import QuantConfig


class ZeroCentredRMSNorm(RMSNorm):
    """HF's Qwen3NextRMSNorm: x / rms(x) * (1 + w). The checkpoint's w loads as 1 + w, so the
    kernels of RMSNorm (and the attention backend's q/k-norm) apply it unchanged."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
        self.weight.weight_loader = lambda param, loaded, shard_id=None: copy_weight(param.data, loaded.float() + 1)


class GatedQKVParallelLinear(QKVParallelLinear):
    """q, k, v in one weight where q carries 2 * head_dim rows per head (its query, then its gate)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 **kwargs):
        tp_size = get_tp_group().world_size
        check_head_split(num_heads, num_kv_heads, tp_size)
        self.head_dim = head_dim
        local_heads, local_kv_heads = num_heads // tp_size, max(1, num_kv_heads // tp_size)
        sizes = [2 * local_heads * tp_size * head_dim] + [local_kv_heads * tp_size * head_dim] * 2
        LinearBase.__init__(self, hidden_size, sizes, bias, **kwargs)
        self.num_heads, self.num_kv_heads = local_heads, local_kv_heads


class GatedAttention(nn.Module):
    """Full attention whose output is scaled by sigmoid(gate) per head before o_proj."""

    def __init__(self, config, prefix: str, quant_config: QuantConfig | None):
        super().__init__()
        self.head_dim = head_dim = head_dim_of(config)
        bias = config.attention_bias
        self.qkv_proj = GatedQKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                               config.num_key_value_heads, bias=bias, quant_config=quant_config,
                                               prefix=f"{prefix}.qkv_proj")
        self.num_heads = self.qkv_proj.num_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias=bias,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        theta, scaling = rope_parameters(config)
        rotary_dim = partial_rotary_dim(config, head_dim)
        section = (getattr(config, "rope_parameters", None) or {}).get("mrope_section")
        if section and scaling is None:  # Qwen3.5: image tokens rotate by three positions
            self.rotary_emb = MRotaryEmbedding(head_dim, rotary_dim, config.max_position_embeddings, theta, section)
        elif section:
            raise ValueError(f"multimodal RoPE with rope scaling {scaling.get('rope_type')!r} is not supported")
        else:
            self.rotary_emb = RotaryEmbedding(head_dim, rotary_dim, config.max_position_embeddings, theta, scaling)
        self.q_norm = ZeroCentredRMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(head_dim, config.rms_norm_eps)
        self.attn = Attention(self.num_heads, head_dim, head_dim**-0.5, self.qkv_proj.num_kv_heads,
                              QKTransform(self.rotary_emb, self.q_norm, self.k_norm), prefix=f"{prefix}.attn")

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        num_tokens, width = hidden.shape[0], self.num_heads * self.head_dim
        query_gate = qkv[:, : 2 * width].view(num_tokens, self.num_heads, 2 * self.head_dim)
        query, gate = query_gate.split(self.head_dim, dim=-1)
        out = self.attn(torch.cat([query.reshape(num_tokens, width), qkv[:, 2 * width :]], dim=-1), positions)
        return self.o_proj(out * torch.sigmoid(gate.reshape(num_tokens, width)))


class Qwen3NextGatedDeltaNet(GatedDeltaNet):
    """Inputs from two projections laid out per key head: in_proj_qkvz (q, k, then the head's value
    heads' v and z) and in_proj_ba (its value heads' b, then a); a rank holds whole key heads."""

    def __init__(self, config, prefix: str, quant_config: QuantConfig | None):
        super().__init__(config, prefix, quant_config)
        hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
        dk, dv = self.head_k_dim, self.head_v_dim
        self.in_proj_qkvz = ColumnParallelLinear(config.hidden_size, hk * (2 * dk) + hv * (2 * dv),
                                                 quant_config=quant_config, prefix=f"{prefix}.in_proj_qkvz")
        self.in_proj_ba = ColumnParallelLinear(config.hidden_size, 2 * hv, quant_config=quant_config,
                                               prefix=f"{prefix}.in_proj_ba")

    def project(self, hidden: torch.Tensor):
        num_tokens, hk, dk, dv = hidden.shape[0], self.num_k_heads, self.head_k_dim, self.head_v_dim
        group = self.num_v_heads // hk  # value heads per key head
        qkvz = self.in_proj_qkvz(hidden).view(num_tokens, hk, 2 * dk + 2 * group * dv)
        q, k, v, z = qkvz.split([dk, dk, group * dv, group * dv], dim=-1)
        b, a = self.in_proj_ba(hidden).view(num_tokens, hk, 2 * group).split(group, dim=-1)
        mixed_qkv = torch.cat([q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v.reshape(num_tokens, -1)], -1)
        return (mixed_qkv, z.reshape(num_tokens, self.num_v_heads, dv), b.reshape(num_tokens, -1),
                a.reshape(num_tokens, -1))


class SharedExpertMoe(SparseMoeBlock):
    """Routed experts plus `shared_expert` scaled by sigmoid(`shared_expert_gate`(x)), per token."""

    def __init__(self, config, prefix: str, quant_config: QuantConfig | None, routing: MoERouting):
        super().__init__(config.hidden_size, config.num_experts, config.moe_intermediate_size, routing, prefix,
                         quant_config)
        self.shared_expert = GatedMLP(config.hidden_size, config.shared_expert_intermediate_size,
                                      f"{prefix}.shared_expert", quant_config, hidden_act=config.hidden_act)
        self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1, prefix=f"{prefix}.shared_expert_gate")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


def hybrid_routing(config, renormalize: bool) -> MoERouting:
    # HF casts the routing weights to the model dtype before weighing the experts.
    return MoERouting(top_k=config.num_experts_per_tok, renormalize=renormalize, weights_in_model_dtype=True)


class HybridDecoderLayer(nn.Module):
    """Pre-norm block over `linear_attn` (a GatedDeltaNet) or `self_attn` (GatedAttention), as
    config.layer_types says, then the MLP; zero-centred norms, the residual add fused into them.
    A family sets `linear_attn_cls` and `make_mlp`."""

    linear_attn_cls: type[GatedDeltaNet]

    def __init__(self, config, prefix: str, quant_config: QuantConfig | None = None):
        super().__init__()
        kind = self.layer_type(config, prefix)
        if kind == "linear_attention":
            self.linear_attn = self.linear_attn_cls(config, f"{prefix}.linear_attn", quant_config)
        elif kind == "full_attention":
            self.self_attn = GatedAttention(config, f"{prefix}.self_attn", quant_config)
        else:
            raise ValueError(f"{prefix}: unknown layer type {kind!r}; expected linear_attention or full_attention")
        self.mlp = self.make_mlp(config, f"{prefix}.mlp", quant_config)
        self.input_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def layer_type(self, config, prefix: str) -> str:
        return config.layer_types[layer_index(prefix)]

    def make_mlp(self, config, prefix: str, quant_config: QuantConfig | None) -> nn.Module:
        raise NotImplementedError

    def forward(self, positions, hidden, residual):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if hasattr(self, "linear_attn"):
            hidden = self.linear_attn(hidden)
        else:
            hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3NextDecoderLayer(HybridDecoderLayer):
    linear_attn_cls = Qwen3NextGatedDeltaNet

    def make_mlp(self, config, prefix: str, quant_config: QuantConfig | None) -> nn.Module:
        if is_sparse_layer(config, layer_index(prefix.rsplit(".", 1)[0])):
            return SharedExpertMoe(config, prefix, quant_config, hybrid_routing(config, config.norm_topk_prob))
        return GatedMLP(config.hidden_size, config.intermediate_size, prefix, quant_config,
                        hidden_act=config.hidden_act)


class HybridForCausalLM(DecoderForCausalLM):
    """The layer stack of a hybrid family; the final norm is zero-centred too; `mtp.*` tensors
    (the multi-token-prediction layer, loaded by the MTP proposer) are skipped."""

    def __init__(self, config, prefix: str = "", quant_config: QuantConfig | None = None):
        super().__init__(config, prefix, quant_config)
        self.model.norm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        if getattr(config, "num_experts", 0):
            self.expert_params_mapping = make_expert_params_mapping(config.num_experts, "gate_proj", "down_proj",
                                                                    "up_proj")

    def skip_checkpoint_weight(self, name: str) -> bool:
        return name.startswith("mtp.") or super().skip_checkpoint_weight(name)


class Qwen3NextMTPDecoderLayer(Qwen3NextDecoderLayer):
    """The MTP layer's block: full gated attention and the shared-expert MoE (dense without experts),
    outside the target's layer_types numbering."""

    def layer_type(self, config, prefix: str) -> str:
        return "full_attention"

    def make_mlp(self, config, prefix: str, quant_config: QuantConfig | None) -> nn.Module:
        if getattr(config, "num_experts", 0):
            return SharedExpertMoe(config, prefix, quant_config, hybrid_routing(config, config.norm_topk_prob))
        return GatedMLP(config.hidden_size, config.intermediate_size, prefix, quant_config,
                        hidden_act=config.hidden_act)


class Qwen3NextMTPLayer(nn.Module):
    """Qwen3-Next's multi-token-prediction layer (published layout, `mtp.*`; transformers does not run
    it): at position t it reads the target's normed hidden state h_t and token t+1 and predicts t+2,

        y_t = norm(block(fc(cat(pre_fc_norm_embedding(embed(token_{t+1})), pre_fc_norm_hidden(h_t)))))

    with zero-centred norms, the target's embedding and LM head (the checkpoint has no copies)."""

    def __init__(self, config, prefix: str, quant_config: QuantConfig | None):
        super().__init__()
        hidden = config.hidden_size
        self.pre_fc_norm_embedding = ZeroCentredRMSNorm(hidden, config.rms_norm_eps)
        self.pre_fc_norm_hidden = ZeroCentredRMSNorm(hidden, config.rms_norm_eps)
        self.fc = ReplicatedLinear(2 * hidden, hidden, bias=False, prefix=f"{prefix}.fc")
        self.layers = nn.ModuleDict({"0": Qwen3NextMTPDecoderLayer(config, f"{prefix}.layers.0", quant_config)})
        self.norm = ZeroCentredRMSNorm(hidden, config.rms_norm_eps)

    def forward_nextn(self, input_ids: torch.Tensor, positions: torch.Tensor, previous_hidden: torch.Tensor,
                      embed: nn.Module, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[T] next tokens, [T] positions, [T, H] previous hidden -> [T, H] normed output (or only
        `rows` of it: indices into T)."""
        x = torch.cat([self.pre_fc_norm_embedding(embed(input_ids)), self.pre_fc_norm_hidden(previous_hidden)], -1)
        hidden, residual = self.layers["0"](positions, self.fc(x), None)
        out = self.norm(hidden, residual)[0]
        return out if rows is None else out.index_select(0, rows)


class Qwen3NextMTP(nn.Module):
    """The MTP layer as a module the loader fills from the target's checkpoint (`mtp.*` only), for
    spec_decode/mtp.py: `layer` drafts; the target's embedding and head serve."""

    checkpoint_prefix = "mtp."
    required_tensor = "mtp.fc.weight"  # what a checkpoint with the layer holds

    def __init__(self, config, quant_config: QuantConfig | None, target_model: nn.Module):
        super().__init__()
        self.config = config
        # The published checkpoints keep fc in bf16 beside FP8 experts, as DeepSeek's eh_proj.
        self.mtp = Qwen3NextMTPLayer(config, "mtp", quant_config)
        self.stacked_params_mapping = target_model.stacked_params_mapping
        self.expert_params_mapping = target_model.expert_params_mapping

    @property
    def layer(self) -> Qwen3NextMTPLayer:
        return self.mtp

    def skip_checkpoint_weight(self, name: str) -> bool:
        return not name.startswith(self.checkpoint_prefix) or "rotary_emb.inv_freq" in name


class Qwen3NextForCausalLM(HybridForCausalLM):
    layer_cls = Qwen3NextDecoderLayer
    mtp_class = Qwen3NextMTP
