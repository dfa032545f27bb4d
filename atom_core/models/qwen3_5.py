"""Qwen3.5 text models (Qwen3_5ForCausalLM dense, Qwen3_5MoeForCausalLM): Qwen3-Next's hybrid stack
(models/qwen3_next.py) with the DeltaNet inputs from four plain projections (in_proj_qkv: q | k | v, in_proj_z,
in_proj_b, in_proj_a); the dense model's every MLP is dense, the MoE model's every MLP routed (renormalised
top-k) plus the gated shared expert. HF's multimodal RoPE gets equal text/height/width positions from text
alone, which is plain RoPE on the first partial_rotary_factor of each head, as here.

The published checkpoints are vision-language models (Qwen3_5ForConditionalGeneration,
Qwen3_5MoeForConditionalGeneration): their `text_config` is this text model's config, with the outer
`vision_config` and image token ids attached (loader/model_dir.py); the text weights sit under
model.language_model.*, the vision tower's (models/qwen3_5_vision.py) under model.visual.*. Images take
HF's interleaved multimodal RoPE (MRotaryEmbedding): `mrope_positions` is HF's get_rope_index."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from atom_core.model_ops.linear import ColumnParallelLinear
from atom_core.model_ops.linear_attention import ConcatColumnParallelLinear, GatedDeltaNet
from atom_core.models.common import GatedMLP
from atom_core.models.qwen3_5_vision import Qwen3_5VisionTower
from atom_core.models.qwen3_next import HybridDecoderLayer, HybridForCausalLM, SharedExpertMoe, hybrid_routing
from atom_core.multimodal.inputs import MultimodalItem
from atom_core.quant import QuantConfig


class Qwen3_5GatedDeltaNet(GatedDeltaNet):
    def __init__(self, config, prefix: str, quant_config: QuantConfig | None):
        super().__init__(config, prefix, quant_config)
        hidden = config.hidden_size
        key = config.linear_num_key_heads * self.head_k_dim
        value = config.linear_num_value_heads * self.head_v_dim
        self.in_proj_qkv = ConcatColumnParallelLinear(hidden, [key, key, value], quant_config=quant_config,
                                                      prefix=f"{prefix}.in_proj_qkv")
        self.in_proj_z = ColumnParallelLinear(hidden, value, quant_config=quant_config, prefix=f"{prefix}.in_proj_z")
        self.in_proj_b = ColumnParallelLinear(hidden, config.linear_num_value_heads, quant_config=quant_config,
                                              prefix=f"{prefix}.in_proj_b")
        self.in_proj_a = ColumnParallelLinear(hidden, config.linear_num_value_heads, quant_config=quant_config,
                                              prefix=f"{prefix}.in_proj_a")

    def project(self, hidden: torch.Tensor):
        z = self.in_proj_z(hidden).view(hidden.shape[0], self.num_v_heads, self.head_v_dim)
        return self.in_proj_qkv(hidden), z, self.in_proj_b(hidden), self.in_proj_a(hidden)


class Qwen3_5DecoderLayer(HybridDecoderLayer):
    linear_attn_cls = Qwen3_5GatedDeltaNet

    def make_mlp(self, config, prefix: str, quant_config: QuantConfig | None) -> nn.Module:
        return GatedMLP(config.hidden_size, config.intermediate_size, prefix, quant_config,
                        hidden_act=config.hidden_act)


class Qwen3_5MoeDecoderLayer(HybridDecoderLayer):
    linear_attn_cls = Qwen3_5GatedDeltaNet

    def make_mlp(self, config, prefix: str, quant_config: QuantConfig | None) -> nn.Module:
        return SharedExpertMoe(config, prefix, quant_config, hybrid_routing(config, renormalize=True))


class Qwen3_5ForCausalLM(HybridForCausalLM):
    layer_cls = Qwen3_5DecoderLayer


class Qwen3_5MoeForCausalLM(HybridForCausalLM):
    layer_cls = Qwen3_5MoeDecoderLayer


def mrope_positions(num_prompt_tokens: int, items: tuple[MultimodalItem, ...], merge: int) -> tuple[np.ndarray, int]:
    """HF's Qwen3.5 get_rope_index for one prompt: text tokens count on from the last position on all
    three axes; an image of (t, h, w) merged patches at position s gets (s + t', s + row, s + col) and
    moves the count on by max(h, w). Returns ([3, P] positions, delta for every later token)."""
    parts, current, previous = [], 0, 0
    for item in items:
        if item.offset > previous:
            parts.append(np.broadcast_to(np.arange(current, current + item.offset - previous), (3, item.offset - previous)))
            current += item.offset - previous
        t, h, w = (int(v) for v in item.data["grid_thw"])
        h, w = h // merge, w // merge
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")).reshape(3, -1)
        assert grid.shape[1] == item.length, f"image grid {t}x{h}x{w} for {item.length} placeholder tokens"
        parts.append(grid + current)
        current += max(h, w)
        previous = item.end
    if num_prompt_tokens > previous:
        parts.append(np.broadcast_to(np.arange(current, current + num_prompt_tokens - previous),
                                     (3, num_prompt_tokens - previous)))
    positions = np.concatenate(parts, axis=1).astype(np.int64)
    return positions, int(positions.max()) + 1 - num_prompt_tokens


class _VisionLanguage:
    """The vision-language model: the text model (model.language_model.* is our model.*) and the vision
    tower (model.visual.* is our visual.*)."""

    supports_images = True

    def __init__(self, config, prefix: str = "", quant_config: QuantConfig | None = None):
        super().__init__(config, prefix, quant_config)
        self.visual = Qwen3_5VisionTower(config.vision_config)
        if self.visual.config.out_hidden_size != config.hidden_size:
            raise ValueError(f"vision out_hidden_size {self.visual.config.out_hidden_size} != text hidden_size "
                             f"{config.hidden_size}")

    def checkpoint_name(self, name: str) -> str:
        for outer, ours in (("model.language_model.", "model."), ("model.visual.", "visual.")):
            if name.startswith(outer):
                return ours + name[len(outer):]
        return name

    def encode_images(self, items: list[MultimodalItem]) -> list[torch.Tensor]:
        return self.visual.encode(items)

    def mrope_positions(self, prompt_token_ids: list[int], items: tuple[MultimodalItem, ...]):
        return mrope_positions(len(prompt_token_ids), items, self.visual.merge) if items else None


class Qwen3_5ForConditionalGeneration(_VisionLanguage, Qwen3_5ForCausalLM):
    pass


class Qwen3_5MoeForConditionalGeneration(_VisionLanguage, Qwen3_5MoeForCausalLM):
    pass
