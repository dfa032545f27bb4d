"""DeepSeek-V2 (greedy routing, no q-LoRA, YaRN with mscale) and DeepSeek-V3 (q-LoRA, grouped
noaux_tc routing with a random correction bias, routed_scaling_factor 2.5, interleaved rope)
against HF transformers greedy, token for token, under several engine settings; MLA's latent
KV cache sizing; the MTP layer skipped at load."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from atom_core import LLMEngine, SamplingParams
from tests.models.harness import assert_same_tokens, hf_greedy, random_prompts

PROMPT_LENS = [1, 9, 40, 130]
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}


def build_tiny_deepseek(path: Path, version: str, seed: int = 0, **overrides) -> Path:
    """3 layers (layer 0 dense), 4 heads, kv_lora_rank 32, nope 16 / rope 16 / v 24, 8 experts top-2
    (config fields in `overrides` replace these)."""
    import transformers as tf

    from tests.tiny_models import build_tokenizer, randomize_weights

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024, kv_lora_rank=32,
                  qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                  eos_token_id=eos, bos_token_id=None, pad_token_id=0)
    common.update(overrides)
    torch.manual_seed(seed)
    if version == "v2":
        config = tf.DeepseekV2Config(**common, q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.5,
                                     rope_parameters=dict(YARN))
        model = tf.DeepseekV2ForCausalLM(config)
    else:
        config = tf.DeepseekV3Config(**common, q_lora_rank=24, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                                     norm_topk_prob=True, rope_interleave=True, rope_parameters=dict(YARN))
        model = tf.DeepseekV3ForCausalLM(config)
    randomize_weights(model)
    model.save_pretrained(str(path))
    tf.GenerationConfig(eos_token_id=eos, pad_token_id=0).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module", params=["v2", "v3"])
def model_and_ref(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = build_tiny_deepseek(tmp_path_factory.mktemp(f"tiny_deepseek_{request.param}"), request.param)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prompts, shared = random_prompts(vocab, PROMPT_LENS), random_prompts(vocab, PROMPT_LENS, shared_prefix=100)
    return path, prompts, hf_greedy(hf, prompts, MAX_TOKENS), shared, hf_greedy(hf, shared, MAX_TOKENS)


def test_defaults(model_and_ref):
    path, prompts, ref, _, _ = model_and_ref
    engine = LLMEngine(str(path))
    assert_same_tokens(engine.generate(prompts, GREEDY), ref, PROMPT_LENS)
    assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks


def test_chunked_prefill(model_and_ref):
    path, prompts, ref, _, _ = model_and_ref
    engine = LLMEngine(str(path), max_num_batched_tokens=64)
    assert_same_tokens(engine.generate(prompts, GREEDY), ref, PROMPT_LENS)


def test_prefix_caching_with_shared_prefixes(model_and_ref):
    path, _, _, shared, shared_ref = model_and_ref
    engine = LLMEngine(str(path), enable_prefix_caching=True)
    assert engine.generate([shared[0]], GREEDY)[0]["token_ids"] == shared_ref[0]
    assert_same_tokens(engine.generate(shared, GREEDY), shared_ref, PROMPT_LENS)
    assert engine.core.kv.num_hit_tokens >= 3 * 96  # 6 full blocks of the 100-token prefix, per later prompt
    assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks


def test_max_num_seqs_two_with_preemption(model_and_ref):
    path, prompts, ref, _, _ = model_and_ref
    engine = LLMEngine(str(path), max_num_seqs=2, num_kv_blocks=11, max_model_len=160)
    assert_same_tokens(engine.generate(prompts, GREEDY), ref, PROMPT_LENS)
    assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks


def test_kv_cache_is_the_latent(model_and_ref):
    """One row of kv_lora_rank + qk_rope_head_dim per token and layer, not heads x 2 x head_dim."""
    from atom_core.model_ops.kv_spec import attention_layers, kv_bytes_per_block

    path = model_and_ref[0]
    engine = LLMEngine(str(path))
    layers = attention_layers(engine.core.executor.runner.model)
    assert [layer.kv_spec.kind for layer in layers] == ["mla"] * 3
    assert kv_bytes_per_block(layers, 16) == 3 * (32 + 16) * 4 * 16  # fp32


def test_mtp_layer_weights_are_skipped(model_and_ref, tmp_path):
    """A checkpoint with model.layers.{num_hidden_layers}.* (the MTP block) still loads."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = model_and_ref[0]
    copy = tmp_path / "with_mtp"
    shutil.copytree(path, copy)
    weights = load_file(str(copy / "model.safetensors"))
    weights["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    weights["model.layers.3.self_attn.kv_b_proj.weight"] = torch.zeros(4 * 40, 32)
    save_file(weights, str(copy / "model.safetensors"), metadata={"format": "pt"})
    engine = LLMEngine(str(copy))
    assert_same_tokens(engine.generate(model_and_ref[1][:2], GREEDY), model_and_ref[2][:2], PROMPT_LENS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("eager", [False, True], ids=["graphs_compiled", "eager"])
def test_cuda_engine_matches_hf(model_and_ref, eager):
    """The Triton path (MLA kernel, CUDA graphs and torch.compile by default) in fp32 against HF
    on the CPU; chunked prefill so prefill chunks, decode rows and mixed batches all occur."""
    path, prompts, ref, _, _ = model_and_ref
    engine = LLMEngine(str(path), device="cuda", dtype="float32", max_num_batched_tokens=64, enforce_eager=eager)
    assert_same_tokens(engine.generate(prompts, GREEDY), ref, PROMPT_LENS)
    assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks
