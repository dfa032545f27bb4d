"""benchmarks/engine/vlm_dir.py: a Qwen3.5 vision-language directory from the 35B-A3B preset, shrunk by
overrides: HF loads every tensor it wrote (per-expert names, nothing missing or unexpected), the 1-D
tensors start as HF initialises them, the chat template puts the image tokens at the config's ids, and
our engine's greedy answer about an image equals HF generate's on the same directory."""
from __future__ import annotations

import pytest
import torch

from benchmarks.engine.vlm_dir import main, saved_tensors
from tests.tiny_vlm import png_bytes, synthetic_image

TEXT = {"num_hidden_layers": 4, "hidden_size": 64, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "vocab_size": 248320,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "num_position_embeddings": 64}


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    import json

    path = tmp_path_factory.mktemp("vlm_dir")
    main(["preset:Qwen3.5-35B-A3B", str(path), "--weights", "random", "--text-overrides", json.dumps(TEXT),
          "--vision-overrides", json.dumps(VISION)])
    return path


def test_hf_loads_every_tensor_written(directory):
    import transformers as tf

    model, info = tf.Qwen3_5MoeForConditionalGeneration.from_pretrained(str(directory), dtype=torch.float32,
                                                                        output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    layers = model.model.language_model.layers
    assert layers[0].input_layernorm.weight.abs().max() < 1e-6  # (1 + w) norms start at w = 0, as HF's
    assert torch.allclose(layers[0].linear_attn.dt_bias.float(), torch.ones(4))
    assert model.model.visual.blocks[0].norm1.weight.float().mean().item() == pytest.approx(1.0)
    assert layers[0].mlp.experts.gate_up_proj.std().item() == pytest.approx(0.02, rel=0.1)
    names = [n for n, _ in saved_tensors(model)]
    assert "model.language_model.layers.0.mlp.experts.3.up_proj.weight" in names


def test_the_template_places_the_image_tokens_at_the_config_ids(directory):
    import json

    import transformers as tf

    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    assert config["vision_config"]["out_hidden_size"] == TEXT["hidden_size"]
    tokenizer = tf.AutoTokenizer.from_pretrained(str(directory))
    for part in ({"type": "image"}, {"type": "image_url", "image_url": {"url": "data:"}}):
        text = tokenizer.apply_chat_template([{"role": "user", "content": [part, {"type": "text", "text": "Hi"}]}],
                                             tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        start = ids.index(config["vision_start_token_id"])
        assert [config["vision_start_token_id"], config["image_token_id"], config["vision_end_token_id"], ord("H"), ord("i")] \
            == ids[start:start + 5]


def test_our_answer_about_an_image_equals_hf(directory, tmp_path):
    import transformers as tf
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from atom_core import LLMEngine, SamplingParams

    image = synthetic_image(3, (300, 260))
    (tmp_path / "a.png").write_bytes(png_bytes(image))
    engine = LLMEngine(str(directory), device="cpu", dtype="float32")
    prompt = engine.image_chat_prompt("What is it?")
    ours = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                           images=[[tmp_path / "a.png"]])[0]["token_ids"]

    import json
    processor = json.loads((directory / "preprocessor_config.json").read_text())
    pix = Qwen2VLImageProcessorPil(**{k: v for k, v in processor.items() if not k.endswith(("_type", "_class"))})(
        images=[image], return_tensors="pt")
    tokenizer = tf.AutoTokenizer.from_pretrained(str(directory))
    text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                       {"type": "text", "text": "What is it?"}]}],
                                         tokenize=False, add_generation_prompt=True)
    count = int(pix["image_grid_thw"].prod()) // 4
    ids = tokenizer(text.replace("<|image_pad|>", "<|image_pad|>" * count), return_tensors="pt",
                    add_special_tokens=False)["input_ids"]
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    hf = tf.Qwen3_5MoeForConditionalGeneration.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pix["pixel_values"],
                          image_grid_thw=pix["image_grid_thw"], mm_token_type_ids=(ids == image_id).int(),
                          max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert ours == out[0, ids.shape[1]:].tolist()
