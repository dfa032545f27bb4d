"""A tiny random Kimi-K2.5 (transformers' Kimi_K25ForConditionalGeneration): a two-layer DeepSeek-V3 text model
(layer 0 dense, layer 1 routed experts), a two-block MoonViT tower of 4-pixel patches over an 8x8 learned position
grid, the 2x2 patch-merger projector. Saved with `save_pretrained`, so the files are what transformers writes
(its original-checkpoint layout: vision_tower.encoder.blocks.N.wqkv, language_model.model.*)."""
from __future__ import annotations

from pathlib import Path

import torch

VISION = dict(patch_size=4, pos_emb_height=8, pos_emb_width=8, pos_emb_time=4, num_attention_heads=2,
              num_hidden_layers=2, hidden_size=32, intermediate_size=64, merge_kernel_size=[2, 2],
              rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})
TEXT = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, n_group=2, topk_group=1, routed_scaling_factor=2.5,
            norm_topk_prob=True, rope_interleave=True, max_position_embeddings=1024, model_type="deepseek_v3")


def kimi_config(vocab_size: int = 400, image_token_id: int = 3, tied: bool = False, **token_ids):
    import transformers as tf

    return tf.Kimi_K25Config(text_config=dict(TEXT, vocab_size=vocab_size), vision_config=dict(VISION),
                             projection_hidden_size=VISION["hidden_size"], image_token_id=image_token_id,
                             tie_word_embeddings=tied, **token_ids)


def build_tiny_kimi(path: Path, config=None, seed: int = 0):
    """Save a tiny random Kimi-K2.5 at `path`; returns transformers' model (eval, float32)."""
    import transformers as tf

    from tests.tiny_models import randomize_weights

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = tf.Kimi_K25ForConditionalGeneration(config or kimi_config()).eval()
    randomize_weights(model)  # the position table is 3-D: drawn as the matrices are
    model.save_pretrained(str(path))
    return model


def random_patches(grids: list[tuple[int, int, int]], patch_size: int = VISION["patch_size"], seed: int = 0):
    """Pixel values [num_patches, 3, p, p] in [-1, 1] (what the processor emits) for images of `grids`."""
    g = torch.Generator().manual_seed(seed)
    num = sum(t * h * w for t, h, w in grids)
    return torch.rand(num, 3, patch_size, patch_size, generator=g) * 2 - 1
