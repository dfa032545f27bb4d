"""The published Qwen3.5 checkpoints' layout: a vision-language model (Qwen3_5ForConditionalGeneration,
Qwen3_5MoeForConditionalGeneration) with the text model's config nested as `text_config`, its weights under
model.language_model.*, a vision tower under model.visual.*, MTP tensors under mtp.*. Served as text: greedy
output equals HF's generate of the whole vision-language model on text-only input."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from atom_core import LLMEngine, SamplingParams
from atom_core.loader.model_dir import resolve_model_files
from tests.models.harness import assert_same_tokens, hf_greedy, random_prompts
from tests.tiny_models import _hybrid_model, build_tokenizer, randomize_weights

PROMPT_LENS = [1, 9, 70]
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
VLMS = {"qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}


def _build_vlm(path, arch: str, tied: bool):
    """A tiny random vision-language model: the tiny hybrid text model of tests/tiny_models.py inside HF's
    ForConditionalGeneration, a two-block vision tower, and one MTP tensor as the published files carry."""
    import transformers as tf

    tokenizer = build_tokenizer(path)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  eos_token_id=eos, bos_token_id=None, pad_token_id=0)
    text = _hybrid_model(arch, common).config.to_dict()
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
    outer = tf.Qwen3_5Config if arch == "qwen3_5" else tf.Qwen3_5MoeConfig
    config = outer(text_config=text, vision_config=vision, tie_word_embeddings=tied, image_token_id=3,
                   video_token_id=4, vision_start_token_id=5, vision_end_token_id=6)
    torch.manual_seed(0)
    model = getattr(tf, VLMS[arch])(config)
    randomize_weights(model)
    model.save_pretrained(str(path))
    tf.GenerationConfig(eos_token_id=eos, pad_token_id=0).save_pretrained(str(path))
    weights = path / "model.safetensors"
    tensors = load_file(str(weights))
    assert any(n.startswith("model.visual.") for n in tensors) and "model.language_model.norm.weight" in tensors
    assert ("lm_head.weight" in tensors) != tied
    tensors["mtp.fc.weight"] = torch.zeros(64, 128)  # the MTP layer is not built for the text model
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module", params=[("qwen3_5", True), ("qwen3_5_moe", False)], ids=["dense_tied", "moe"])
def vlm_and_ref(request, tmp_path_factory):
    import transformers as tf

    arch, tied = request.param
    path = _build_vlm(tmp_path_factory.mktemp(f"tiny_{arch}_vlm"), arch, tied)
    hf = getattr(tf, VLMS[arch]).from_pretrained(str(path), dtype=torch.float32).eval()
    prompts = random_prompts(hf.config.text_config.vocab_size, PROMPT_LENS)
    return arch, path, prompts, hf_greedy(hf, prompts, MAX_TOKENS)


def test_config_is_the_text_config_under_the_outer_architecture(vlm_and_ref):
    arch, path, _, _ = vlm_and_ref
    hf = resolve_model_files(str(path)).hf_config
    assert hf.architectures == [VLMS[arch]] and hf.layer_types[3] == "full_attention"
    assert hf.tie_word_embeddings == (arch == "qwen3_5")  # HF ties by the outer config


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 32}, {"enable_prefix_caching": True},
                                     {"max_num_seqs": 2}], ids=["defaults", "chunked", "prefix_caching", "two_seqs"])
def test_text_greedy_equals_hf(vlm_and_ref, options):
    """The four engine settings on the checkpoint layout (tests/models/test_hybrid_engine.py goes deeper into
    each: preemption, shared prefixes)."""
    _, path, prompts, ref = vlm_and_ref
    engine = LLMEngine(str(path), **options)
    assert_same_tokens(engine.generate(prompts, GREEDY), ref, PROMPT_LENS)


def test_quantization_module_names_move_to_the_text_model(tmp_path):
    """A block-FP8 release's modules_to_not_convert name checkpoint modules (model.language_model.*): they
    must name our modules (model.*) for the FP8 method to skip them."""
    import transformers as tf

    config = tf.Qwen3_5Config(text_config=dict(num_hidden_layers=1, layer_types=["full_attention"]))
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    config.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128],
                                  "modules_to_not_convert": ["model.language_model.layers.0.mlp.gate",
                                                             "model.visual.blocks.0", r"re:model\.language_model\.x"]}
    config.save_pretrained(str(tmp_path))
    qc = resolve_model_files(str(tmp_path)).hf_config.quantization_config
    assert qc["modules_to_not_convert"] == ["model.layers.0.mlp.gate", "model.visual.blocks.0", r"re:model\.x"]
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
