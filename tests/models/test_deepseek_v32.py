"""DeepSeek-V3.2 (DeepseekV32ForCausalLM) and GLM-5 (GlmMoeDsaForCausalLM): MLA with DeepSeek Sparse
Attention against HF transformers greedy, token for token, under the four engine settings, with
index_topk 8 far below the 40-80 token prompts (the selection drops most tokens) and with prompts
shorter than index_topk (the dense side of the switch); the indexer's selection against HF's on a
fixed input; the indexer key cache in the KV spec."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from atom_core import LLMEngine, SamplingParams
from tests.models.harness import assert_same_tokens, hf_greedy, random_prompts

INDEX_TOPK = 8
PROMPT_LENS = [40, 57, 80, 3]
SHORT_LENS = [1, 4, 7]  # with the tokens they generate, still longer than index_topk at the end
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def build_tiny_dsa(path: Path, family: str, seed: int = 0) -> Path:
    """2 layers (layer 0 dense, layer 1 MoE), hidden 64, 4 heads, kv_lora_rank 32, q_lora_rank 24,
    nope 16 / rope 16 / v 24, 8 experts top-2, indexer 8 heads of 32, index_topk 8. GLM-5's
    second layer is a "shared" one (no indexer: it reuses layer 0's selection)."""
    import transformers as tf

    from tests.tiny_models import build_tokenizer, randomize_weights

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024, kv_lora_rank=32,
                  q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                  n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                  index_topk=INDEX_TOPK, index_head_dim=32, index_n_heads=8,
                  eos_token_id=eos, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(seed)
    if family == "v32":
        model = tf.DeepseekV32ForCausalLM(tf.DeepseekV32Config(**common))
    else:
        model = tf.GlmMoeDsaForCausalLM(tf.GlmMoeDsaConfig(**common, indexer_types=["full", "shared"]))
    randomize_weights(model)
    model.save_pretrained(str(path))
    tf.GenerationConfig(eos_token_id=eos, pad_token_id=0).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module", params=["v32", "glm5"])
def model_and_ref(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = build_tiny_dsa(tmp_path_factory.mktemp(f"tiny_dsa_{request.param}"), request.param)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prompts, shared = random_prompts(vocab, PROMPT_LENS), random_prompts(vocab, PROMPT_LENS, shared_prefix=36)
    short = random_prompts(vocab, SHORT_LENS)
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in (prompts, shared, short)]
    return path, (prompts, shared, short), refs, hf


def test_defaults(model_and_ref):
    path, (prompts, _, _), (ref, _, _), _ = model_and_ref
    engine = LLMEngine(str(path))
    assert_same_tokens(engine.generate(prompts, GREEDY), ref, PROMPT_LENS)
    assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks
