"""Blocks shared by the dense decoder-only families (Llama, Qwen3, Mistral-style configs)."""
from __future__ import annotations

import torch
from torch import nn

from atom_core.model_ops.activation import SiluAndMul
from atom_core.model_ops.attention import Attention
from atom_core.model_ops.embed_head import LMHead, VocabEmbedding
from atom_core.model_ops.layernorm import RMSNorm
from atom_core.model_ops.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from atom_core.model_ops.rotary import RotaryEmbedding, rope_parameters


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class SelfAttention(nn.Module):
    """QKV projection, then (optional per-head q/k RMSNorm (Qwen3), RoPE, KV store, paged attention), o_proj."""

    def __init__(self, config, prefix: str, qk_norm: bool):
        super().__init__()
        self.head_dim = head_dim_of(config)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, bias=bias)
        self.o_proj = RowParallelLinear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        theta, scaling = rope_parameters(config)
        self.rotary_emb = RotaryEmbedding(self.head_dim, self.head_dim, config.max_position_embeddings, theta, scaling)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = qk_norm

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # q/k-norm and RoPE run inside the attention op, fused with the KV store (one kernel).
        norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else (None, None, 1e-6)
        out = self.attn(self.qkv_proj(hidden), positions, self.rotary_emb.cos_sin_cache, *norm)
        return self.o_proj(out)


class GatedMLP(nn.Module):
    def __init__(self, config, prefix: str):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; expected silu")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config, prefix: str, qk_norm: bool):
        super().__init__()
        self.self_attn = SelfAttention(config, f"{prefix}.self_attn", qk_norm)
        self.mlp = GatedMLP(config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, config, prefix: str, qk_norm: bool):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, f"{prefix}.layers.{i}", qk_norm) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(nn.Module):
    """model + lm_head; subclasses pick qk_norm. compute_logits runs on the sampled rows only."""

    qk_norm = False
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, prefix: str = ""):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, "model", self.qk_norm)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
