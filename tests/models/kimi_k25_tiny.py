"""A tiny random Kimi-K2.5 (transformers' Kimi_K25ForConditionalGeneration): a two-layer DeepSeek-V3 text model
(layer 0 dense, layer 1 routed experts), a two-block MoonViT tower of 4-pixel patches over an 8x8 learned position
grid, the 2x2 patch-merger projector. Saved with `save_pretrained`, so the files are what transformers writes
(its original-checkpoint layout: vision_tower.encoder.blocks.N.wqkv, language_model.model.*)."""
from __future__ import annotations

import json
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


# Images over 16 x 16 patches (64 pixels a side) are shrunk: tests see the resize as well as the padding.
PREPROCESSOR = {"image_processor_type": "Kimi_K25ImageProcessor", "processor_class": "Kimi_K25Processor",
                "patch_size": VISION["patch_size"], "merge_size": 2, "max_patches": 256,
                "size": {"max_height": 16, "max_width": 16}, "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5], "rescale_factor": 1 / 255, "resample": 3, "do_resize": True,
                "do_rescale": True, "do_normalize": True, "do_convert_rgb": True}


def build_tiny_kimi(path: Path, seed: int = 0, tied: bool = False):
    """Save a tiny random Kimi-K2.5 at `path` with its tokenizer (image token <|media_pad|>), preprocessor
    config and generation config; returns transformers' model (eval, float32)."""
    import transformers as tf

    from tests.tiny_models import randomize_weights

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_kimi_tokenizer(path)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|media_pad|>", "<|media_begin|>", "<|media_end|>",
                                                             "<|im_end|>")}
    config = kimi_config(len(tokenizer), ids["<|media_pad|>"], tied, vision_start_token_id=ids["<|media_begin|>"],
                         vision_end_token_id=ids["<|media_end|>"], video_token_id=0)
    torch.manual_seed(seed)
    model = tf.Kimi_K25ForConditionalGeneration(config).eval()
    randomize_weights(model)  # the position table is 3-D: drawn as the matrices are
    model.save_pretrained(str(path))
    tf.GenerationConfig(eos_token_id=ids["<|im_end|>"], pad_token_id=0).save_pretrained(str(path))
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return model


def random_patches(grids: list[tuple[int, int, int]], patch_size: int = VISION["patch_size"], seed: int = 0):
    """Pixel values [num_patches, 3, p, p] in [-1, 1] (what the processor emits) for images of `grids`."""
    g = torch.Generator().manual_seed(seed)
    num = sum(t * h * w for t, h, w in grids)
    return torch.rand(num, 3, patch_size, patch_size, generator=g) * 2 - 1


# Kimi-K2.5's chat layout: <|im_user|>user<|im_middle|>...<|im_end|>; an image part becomes
# <|media_begin|>image<|media_content|><|media_pad|><|media_end|> (the processor repeats <|media_pad|>).
KIMI_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' or c['type'] == 'image_url' %}"
    "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)
KIMI_SPECIAL = ["<|endoftext|>", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
                "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>"]


def build_kimi_tokenizer(path: Path, vocab_size: int = 400):
    """A byte-level BPE tokenizer with Kimi's chat and media special tokens and a Kimi-style chat template."""
    from tests.tiny_models import build_tokenizer

    return build_tokenizer(path, vocab_size, special_tokens=KIMI_SPECIAL, chat_template=KIMI_CHAT_TEMPLATE)


def synthetic_image(seed: int, size: tuple[int, int], mode: str = "RGB"):
    """A seeded random-noise PIL image of `size` (height, width) in `mode`."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).convert(mode)


# transformers' vision_config field -> the published checkpoint's (moonshotai/Kimi-K2.5 config.json)
PUBLISHED_VISION_NAMES = {"hidden_size": "vt_hidden_size", "intermediate_size": "vt_intermediate_size",
                          "num_attention_heads": "vt_num_attention_heads", "num_hidden_layers": "vt_num_hidden_layers",
                          "pos_emb_height": "init_pos_emb_height", "pos_emb_width": "init_pos_emb_width",
                          "pos_emb_time": "init_pos_emb_time"}


def to_published_layout(src: Path, dst: Path) -> Path:
    """A copy of transformers' saved tiny Kimi-K2.5 in the published files' layout: config.json as the
    trust_remote_code release writes it (KimiK25ForConditionalGeneration, auto_map, kimi_k2 text model,
    vt_* / init_pos_emb_* vision fields, media_placeholder_token_id, projector fields inside vision_config)
    and the release's tensor names (language_model.model.layers.N, vision_tower.patch_embed.*,
    mm_projector.pre_norm.*)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    config = json.loads((src / "config.json").read_text())
    vision = {PUBLISHED_VISION_NAMES.get(k, k): v for k, v in config["vision_config"].items() if k != "rope_parameters"}
    vision.update(mm_hidden_size=config.pop("projection_hidden_size"), merge_type="sd2_tpool",
                  projector_ln_eps=config.pop("projection_layer_norm_eps"), pos_emb_type="divided_fixed",
                  mm_projector_type="patchmerger", projector_hidden_act="gelu",
                  text_hidden_size=config["text_config"]["hidden_size"])
    text = dict(config["text_config"], model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"],
                topk_method="noaux_tc", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"})
    config.update(architectures=["KimiK25ForConditionalGeneration"], vision_config=vision, text_config=text,
                  media_placeholder_token_id=config.pop("image_token_id"),
                  auto_map={"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                            "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration"})
    (dst / "config.json").write_text(json.dumps(config))
    renames = (("language_model.model.blocks.", "language_model.model.layers."),
               ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed."),
               ("model.mm_projector.", "mm_projector."))
    tensors = {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        for old, new in renames:
            name = new + name[len(old):] if name.startswith(old) else name
        tensors[name] = tensor
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst
