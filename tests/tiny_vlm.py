"""A tiny random Qwen3.5 vision-language model (dense or MoE) with what its HF processor needs: a
tokenizer carrying the image special tokens and a Qwen-style chat template that places them, and a
preprocessor_config.json. Plus small synthetic images and the reference HF inputs for them (built
without torchvision: HF's PIL image processor class and the tokenizer)."""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import torch

from tests.tiny_models import _hybrid_model, build_tokenizer, randomize_weights

IMAGE_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VLM_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VLMS = {"qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
PATCH, MERGE = 4, 2
# Few pixels per image keep the prompts short: 8..48 merged tokens per image.
PREPROCESSOR = {"patch_size": PATCH, "merge_size": MERGE, "temporal_patch_size": 2,
                "size": {"shortest_edge": 8 * 16 * 4, "longest_edge": 48 * 16 * 4},
                "image_mean": [0.5, 0.45, 0.4], "image_std": [0.25, 0.3, 0.27], "resample": 3,
                "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor"}


def build_tiny_vlm(path: Path, arch: str = "qwen3_5", seed: int = 0) -> Path:
    """head_dim 32 with a quarter rotated: 4 rotary frequencies (temporal, height, width, temporal under
    mrope_section [2, 1, 1]), so all three position axes reach attention."""
    import transformers as tf

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path)
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    tokenizer.chat_template = VLM_TEMPLATE
    tokenizer.save_pretrained(str(path))
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in IMAGE_TOKENS}
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  eos_token_id=eos, bos_token_id=None, pad_token_id=0)
    text = _hybrid_model(arch, common).config.to_dict()
    text["head_dim"] = 32
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                               "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=PATCH,
                  spatial_merge_size=MERGE, temporal_patch_size=2, num_position_embeddings=16)
    outer = tf.Qwen3_5Config if arch == "qwen3_5" else tf.Qwen3_5MoeConfig
    config = outer(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                   video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                   vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(seed)
    model = getattr(tf, VLMS[arch])(config)
    randomize_weights(model)
    model.save_pretrained(str(path))
    tf.GenerationConfig(eos_token_id=eos, pad_token_id=0).save_pretrained(str(path))
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return path


def synthetic_image(seed: int, size: tuple[int, int], mode: str = "RGB"):
    """A smooth random picture (gradients + noise) of `size` (width, height)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = size
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([(x * rng.uniform(1, 4) + y * rng.uniform(0, 3)) % 256 for _ in range(3)], axis=-1)
    pixels = np.clip(base + rng.normal(0, 30, base.shape), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels, "RGB")
    return image.convert(mode) if mode != "RGB" else image


def png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def hf_image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    kwargs = {k: v for k, v in PREPROCESSOR.items() if k not in ("image_processor_type", "processor_class")}
    return Qwen2VLImageProcessorPil(**kwargs)


def hf_inputs(tokenizer, messages: list[dict], images: list) -> dict:
    """What HF's Qwen3VLProcessor gives for a chat: the template's text with each <|image_pad|> expanded to
    the image's merged-patch count, tokenized, plus the PIL processor's pixels and grids and the
    mm_token_type_ids HF's get_rope_index reads."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = {}
    if images:
        pix = hf_image_processor()(images=images, return_tensors="pt")
        parts = text.split("<|image_pad|>")
        assert len(parts) == len(images) + 1
        counts = (pix["image_grid_thw"].prod(-1) // MERGE**2).tolist()
        text = parts[0] + "".join("<|image_pad|>" * n + p for n, p in zip(counts, parts[1:]))
        out.update(pixel_values=pix["pixel_values"], image_grid_thw=pix["image_grid_thw"])
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    out.update(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == image_id).int())
    return out


@torch.inference_mode()
def hf_generate(model, inputs: dict, max_tokens: int) -> list[int]:
    out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens)
    return out[0, inputs["input_ids"].shape[1]:].tolist()
