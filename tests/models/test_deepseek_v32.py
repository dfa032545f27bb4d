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


def build_tiny_dsa(path: Path, family: str, seed: int = 0, num_layers: int = 2) -> Path:
    """2 layers (layer 0 dense, layer 1 MoE), hidden 64, 4 heads, kv_lora_rank 32, q_lora_rank 24,
    nope 16 / rope 16 / v 24, 8 experts top-2, indexer 8 heads of 32, index_topk 8. GLM-5's
    second layer is a "shared" one (no indexer: it reuses layer 0's selection); layers past it
    (num_layers > 2) are "full"."""
    import transformers as tf

    from tests.tiny_models import build_tokenizer, randomize_weights

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers,
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
        model = tf.GlmMoeDsaForCausalLM(tf.GlmMoeDsaConfig(**common, indexer_types=["full", "shared"] + ["full"] * (num_layers - 2)))
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


def test_chunked_prefill(model_and_ref):
    path, (prompts, _, _), (ref, _, _), _ = model_and_ref
    engine = LLMEngine(str(path), max_num_batched_tokens=32)
    assert_same_tokens(engine.generate(prompts, GREEDY), ref, PROMPT_LENS)


def test_prefix_caching_with_shared_prefixes(model_and_ref):
    """The indexer keys of cached blocks come back with the latent: later prompts hit 2 blocks."""
    path, (_, shared, _), (_, shared_ref, _), _ = model_and_ref
    engine = LLMEngine(str(path), enable_prefix_caching=True)
    assert engine.generate([shared[0]], GREEDY)[0]["token_ids"] == shared_ref[0]
    assert_same_tokens(engine.generate(shared, GREEDY), shared_ref, PROMPT_LENS)
    assert engine.core.kv.num_hit_tokens >= 3 * 32
    assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks


def test_max_num_seqs_two_with_preemption(model_and_ref):
    path, (prompts, _, _), (ref, _, _), _ = model_and_ref
    engine = LLMEngine(str(path), max_num_seqs=2, num_kv_blocks=9, max_model_len=100)
    assert_same_tokens(engine.generate(prompts, GREEDY), ref, PROMPT_LENS)
    assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks


def test_prompts_shorter_than_index_topk(model_and_ref):
    """Prefill (and the first decodes) of prompts under index_topk run dense MLA; the decodes
    past it select."""
    path, (_, _, short), (_, _, short_ref), _ = model_and_ref
    engine = LLMEngine(str(path))
    assert_same_tokens(engine.generate(short, GREEDY), short_ref, SHORT_LENS)


def test_selection_changes_the_output(model_and_ref):
    """HF with an index_topk no prompt reaches (dense attention) generates other tokens than the
    reference: the tests above see the selection."""
    _, (prompts, _, _), (ref, _, _), hf = model_and_ref
    indexers = [layer.self_attn.indexer for layer in hf.model.layers if layer.self_attn.indexer is not None]
    for indexer in indexers:
        indexer.index_topk = 10_000
    try:
        dense = hf_greedy(hf, prompts[:3], MAX_TOKENS)
    finally:
        for indexer in indexers:
            indexer.index_topk = INDEX_TOPK
    assert dense != ref[:3]


def test_kv_spec_counts_the_indexer_keys(model_and_ref):
    """Per token and layer: the latent (32 + 16) plus, on layers with an indexer, its 32-dim key;
    GLM-5's shared layer stores no key."""
    from atom_core.model_ops.kv_spec import attention_layers, kv_bytes_per_block

    path = model_and_ref[0]
    engine = LLMEngine(str(path))
    layers = attention_layers(engine.core.executor.runner.model)
    index_dims = [layer.kv_spec.index_head_dim for layer in layers]
    assert index_dims == ([32, 32] if "v32" in path.name else [32, 0])
    assert kv_bytes_per_block(layers, 16) == sum(48 + d for d in index_dims) * 4 * 16  # fp32
    assert tuple(layers[0].index_cache.shape[1:]) == (16, 1, 32)


def test_fp8_index_keys_in_the_kv_spec(model_and_ref):
    """--index-cache-dtype fp8: each indexer key costs 32 e4m3 bytes plus one float32 scale; the
    engine runs (selection by FP8 scores) and frees every block."""
    from atom_core.model_ops.kv_spec import attention_layers, kv_bytes_per_block

    path, (prompts, _, _), _, _ = model_and_ref
    engine = LLMEngine(str(path), index_cache_dtype="fp8")
    outputs = engine.generate(prompts, GREEDY)
    assert [len(o["token_ids"]) for o in outputs] == [MAX_TOKENS] * len(prompts)
    layers = attention_layers(engine.core.executor.runner.model)
    index_bytes = [36 if layer.kv_spec.index_head_dim else 0 for layer in layers]
    assert kv_bytes_per_block(layers, 16) == sum(48 * 4 + b for b in index_bytes) * 16
    assert layers[0].index_cache.dtype == torch.float8_e4m3fn and layers[0].index_scale_cache.shape[1:] == (16, 1)
    assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks


def test_fp8_index_keys_refused_without_an_indexer(tiny_llama):
    with pytest.raises(ValueError, match="no sparse-attention indexer"):
        LLMEngine(str(tiny_llama), index_cache_dtype="fp8")


def test_unknown_index_cache_dtype_refused():
    from atom_core.config import CacheConfig

    with pytest.raises(ValueError, match="index_cache_dtype"):
        CacheConfig(index_cache_dtype="int8")


@torch.inference_mode()
@pytest.mark.parametrize("index_dtype", ["auto", "fp8"])
def test_indexer_selection_equals_hf(model_and_ref, index_dtype):
    """Layer 0's selected token sets on one 60-token prefill equal HF's indexer top-k (its rows
    below index_topk pick masked future tokens too: only those at or before the row count).
    With FP8 indexer keys (HF has no such path) the sets overlap HF's in most positions."""
    from transformers import AutoConfig

    from atom_core.loader import build_model
    from atom_core.model_ops.forward_context import AttentionMetadata, set_attention_metadata
    from atom_core.model_ops.kv_spec import (allocate_kv_cache, attention_layers, release_kv_cache,
                                             set_index_cache_dtype)

    path, _, _, hf = model_and_ref
    n = 60
    torch.manual_seed(7)
    x = torch.randn(1, n, 64)
    pos = torch.arange(n)[None]
    hf_attn = hf.model.layers[0].self_attn
    q_resid = hf_attn.q_a_layernorm(hf_attn.q_a_proj(x))
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None]
    hf_topk = hf_attn.indexer(x, q_resid, hf.model.rotary_emb(x, pos), causal, pos)[0]  # [n, topk]

    model = build_model(AutoConfig.from_pretrained(str(path)), path, torch.float32, "cpu")
    layers = attention_layers(model)
    set_index_cache_dtype(layers, index_dtype)
    allocate_kv_cache(layers, 4, 16, "cpu")
    try:
        attn = model.model.layers[0].self_attn
        layer = attn.mla_attn
        backend = layer.backend(torch.device("cpu"))
        i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
        meta = AttentionMetadata(i32([0, n]), i32([n]), torch.arange(4, dtype=torch.int32)[None],
                                 torch.arange(n), n, n)
        with set_attention_metadata(meta):
            index_q, index_k, weights = attn.indexer(x[0], q_resid[0])
            index_q = backend._rope_store_index_keys(layer, index_q, index_k, pos[0], meta.slot_mapping)
            slots = backend.select(layer, index_q, weights, meta)  # identity block table: slot == position
    finally:
        release_kv_cache(layers)
    kept = 0
    for t in range(n):
        expected = sorted(p for p in hf_topk[t].tolist() if p <= t)
        got = sorted(s for s in slots[t].tolist() if s >= 0)
        if index_dtype == "auto":
            assert got == expected, f"row {t}"
        kept += len(set(got) & set(expected))
    total = sum(min(t + 1, INDEX_TOPK) for t in range(n))
    assert kept >= (0.8 if index_dtype == "fp8" else 1.0) * total


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("eager", [False, True], ids=["graphs_compiled", "eager"])
def test_cuda_engine_matches_hf(model_and_ref, eager):
    """The Triton path (indexer, top-k, sparse MLA; CUDA graphs and torch.compile by default) in
    fp32 against HF on the CPU, with chunked prefill so chunks, decodes and mixed steps occur."""
    path, (prompts, _, _), (ref, _, _), _ = model_and_ref
    engine = LLMEngine(str(path), device="cuda", dtype="float32", max_num_batched_tokens=32, enforce_eager=eager)
    assert_same_tokens(engine.generate(prompts, GREEDY), ref, PROMPT_LENS)
