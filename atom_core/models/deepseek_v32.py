"""DeepSeek-V3.2 (DeepseekV32ForCausalLM) and GLM-5 (GlmMoeDsaForCausalLM): DeepSeek-V3's MLA + MoE
with DeepSeek Sparse Attention. Each layer's lightning indexer (`self_attn.indexer`: wq_b from the
q-LoRA latent, wk + LayerNorm k_norm from the hidden state, weights_proj for per-head weights)
picks the `index_topk` cached tokens each query attends to (model_ops/mla.py SparseMLAAttention;
the math in kernels/dsa_ref.py). HF's reference (transformers deepseek_v32 / glm_moe_dsa) scores in
bf16/fp32 without the public recipe's Hadamard rotation and FP8 keys; so do we by default
(--index-cache-dtype fp8 selects the recipe's keys: model_ops/mla.py, kv_spec.py).

V3.2 ropes the indexer's first qk_rope_head_dim dims as neox halves, GLM-5 as interleaved pairs;
GLM-5 layers of `indexer_types` "shared" have no indexer and reuse the selection of the last
"full" layer before them. Routing is V3's noaux_tc; the MTP layer (model.layers.{num_hidden_layers},
an MLA + MoE block with its own indexer) is built by spec_decode/mtp.py from `layer_cls`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom_core.model_ops.linear import ReplicatedLinear
from atom_core.model_ops.mla import SparseMLAAttention, TopkSelection
from atom_core.models.common import layer_index
from atom_core.models.deepseek_v2 import (
    DeepseekV2Attention, DeepseekV2DecoderLayer, DeepseekV3ForCausalLM, mla_softmax_scale,
)
from atom_core.quant import QuantConfig

INDEXER_NORM_EPS = 1e-6  # HF builds the indexer's k_norm (a LayerNorm) with this eps


class LayerNorm(nn.Module):
    """nn.LayerNorm's parameters (weight, bias) and math, in float32 like HF's fp32 LayerNorm kernel."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class Indexer(nn.Module):
    """The lightning indexer's projections (replicated under TP: every rank selects the same
    tokens). Returns its query [T, Hi * D] and key [T, D] before RoPE and its head weights
    [T, Hi] float32 times Hi^-0.5. weights_proj stays unquantized (HF keeps it in fp32; the FP8
    checkpoints store it unquantized)."""

    def __init__(self, config, prefix: str, quant_config: QuantConfig | None):
        super().__init__()
        self.n_heads, head_dim = config.index_n_heads, config.index_head_dim
        self.wq_b = ReplicatedLinear(config.q_lora_rank, self.n_heads * head_dim, quant_config=quant_config,
                                     prefix=f"{prefix}.wq_b")
        self.wk = ReplicatedLinear(config.hidden_size, head_dim, quant_config=quant_config, prefix=f"{prefix}.wk")
        self.k_norm = LayerNorm(head_dim, INDEXER_NORM_EPS)
        self.weights_proj = ReplicatedLinear(config.hidden_size, self.n_heads, prefix=f"{prefix}.weights_proj")

    def forward(self, hidden: torch.Tensor, q_resid: torch.Tensor):
        weights = self.weights_proj(hidden).float() * self.n_heads ** -0.5
        return self.wq_b(q_resid), self.k_norm(self.wk(hidden)), weights


def has_indexer(config, index: int) -> bool:
    """GLM-5's `indexer_types` (per decoder layer; the MTP layer past them runs its own)."""
    types = getattr(config, "indexer_types", None)
    return types is None or index >= len(types) or types[index] == "full"


class DeepseekV32Attention(DeepseekV2Attention):
    """DeepSeek-V3's MLA projections (q-LoRA required: the indexer reads its latent) with a
    sparse MLA layer in place of the dense one, and the layer's indexer where it has one."""

    index_interleaved = False

    def __init__(self, config, prefix: str, quant_config: QuantConfig | None = None):
        if config.q_lora_rank is None:
            raise ValueError("DeepSeek sparse attention needs q_lora_rank (the indexer reads the q latent); "
                             "this config has none")
        super().__init__(config, prefix, quant_config)
        self.indexer = Indexer(config, f"{prefix}.indexer", quant_config) if self.mla_attn.has_indexer else None

    def make_mla(self, config, prefix: str) -> SparseMLAAttention:
        return SparseMLAAttention(
            self.num_local_heads, config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim,
            self.kv_lora_rank, mla_softmax_scale(config), self.rotary_emb, self.kv_a_layernorm, self.kv_b_proj,
            True, index_n_heads=config.index_n_heads, index_head_dim=config.index_head_dim,
            index_topk=config.index_topk, index_interleaved=self.index_interleaved, selection=TopkSelection(),
            has_indexer=has_indexer(config, layer_index(prefix.rsplit(".", 1)[0])), prefix=f"{prefix}.mla_attn")

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q_resid = self.q_a_layernorm(self.q_a_proj(hidden))
        q = self.q_b_proj(q_resid).view(-1, self.num_local_heads, self.qk_head_dim)
        kv_a = self.kv_a_proj_with_mqa(hidden)  # [T, C + R]
        index = self.indexer(hidden, q_resid) if self.indexer is not None else ()
        return self.o_proj(self.mla_attn(q, kv_a, positions, *index))


class GlmMoeDsaAttention(DeepseekV32Attention):
    index_interleaved = True


class DeepseekV32DecoderLayer(DeepseekV2DecoderLayer):
    attention_cls = DeepseekV32Attention


class GlmMoeDsaDecoderLayer(DeepseekV32DecoderLayer):
    attention_cls = GlmMoeDsaAttention


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    layer_cls = DeepseekV32DecoderLayer

    def __init__(self, config, prefix: str = "", quant_config: QuantConfig | None = None):
        super().__init__(config, prefix, quant_config)
        layers = [m for m in self.modules() if isinstance(m, SparseMLAAttention)]
        if not layers[0].has_indexer:
            raise ValueError("the first decoder layer must run its own indexer (indexer_types[0] == 'full'), "
                             f"got {getattr(config, 'indexer_types', None)}")
        shared = TopkSelection()  # the "shared" layers read what the last indexer layer selected
        for layer in layers:
            layer.selection = shared


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    layer_cls = GlmMoeDsaDecoderLayer
