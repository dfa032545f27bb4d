"""Hybrid linear-attention families (Qwen3-Next, Qwen3.5 dense and MoE) in the engine, greedy token for
token against HF transformers on tiny random models, in every scheduling regime, with prompts longer than
the gated-delta-rule kernels' 64-token chunk; and the state slots' bookkeeping (admission, abort,
preemption, finish) and the rules these models get (no prefix reuse, no draft-model speculation)."""
import json
import logging

import pytest
import torch

from atom_core import LLMEngine, SamplingParams
from tests.models.harness import assert_same_tokens, hf_greedy, random_prompts
from tests.tiny_models import HYBRID_ARCHS, build_tiny_model

PROMPT_LENS = [1, 9, 60, 74, 130]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _hf_greedy(path, prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return hf_greedy(model, prompts, MAX_TOKENS)


@pytest.fixture(scope="module", params=HYBRID_ARCHS)
def model_and_ref(request, tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp(f"tiny_{request.param}"), request.param)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(vocab, PROMPT_LENS)
    shared = random_prompts(vocab, [5, 40], shared_prefix=70)
    return path, prompts, _hf_greedy(path, prompts), shared, _hf_greedy(path, shared)


def _all_returned(engine) -> None:
    kv = engine.core.kv
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.num_free_state_slots == kv.num_state_slots > 0


def test_defaults(model_and_ref):
    path, prompts, ref, _, _ = model_and_ref
    engine = LLMEngine(str(path))
    assert_same_tokens(engine.generate(prompts, GREEDY), ref, PROMPT_LENS)
    _all_returned(engine)


def test_chunked_prefill_carries_the_state(model_and_ref):
    path, prompts, ref, _, _ = model_and_ref
    engine = LLMEngine(str(path), max_num_batched_tokens=32)  # 130 tokens: five chunks, decodes beside them
    assert_same_tokens(engine.generate(prompts, GREEDY), ref, PROMPT_LENS)
    _all_returned(engine)


def test_prefix_caching_reuses_nothing(model_and_ref, caplog):
    path, _, _, shared, shared_ref = model_and_ref
    with caplog.at_level(logging.WARNING, logger="atom_core.engine.kv_cache"):
        engine = LLMEngine(str(path), enable_prefix_caching=True)
    assert "prefix caching is off" in caplog.text
    assert engine.generate([shared[0]], GREEDY)[0]["token_ids"] == shared_ref[0]
    assert_same_tokens(engine.generate(shared, GREEDY), shared_ref, [75, 110])
    assert engine.core.kv.num_hit_tokens == 0  # a cached block would skip the state's update by its tokens
    _all_returned(engine)


def test_max_num_seqs_two_with_preemption(model_and_ref):
    path, prompts, ref, _, _ = model_and_ref
    # 60 and 74 tokens run together in 9 of the 10 blocks; both need one more while decoding
    engine = LLMEngine(str(path), max_num_seqs=2, num_kv_blocks=10, max_model_len=160)
    assert_same_tokens(engine.generate(prompts, GREEDY), ref, PROMPT_LENS)
    assert engine.core.scheduler.num_preemptions > 0  # a preempted sequence restarts from a fresh state
    assert engine.core.kv.num_state_slots == 2
    _all_returned(engine)


# Qwen3.5 MoE is left out: its layers are Qwen3.5's DeltaNet (four projections) and Qwen3-Next's shared-expert
# MoE, whose splits across ranks the two cases here already run; a TP case costs two rank processes.
@pytest.mark.parametrize("model_and_ref", ["qwen3_next", "qwen3_5"], indirect=True)
def test_tensor_parallel_two_ranks(model_and_ref):
    """Two ranks on the CPU (gloo): key/value heads, conv channels (q | k | v part by part), A_log and
    dt_bias split; each rank keeps its heads' states."""
    path, prompts, ref, _, _ = model_and_ref
    engine = LLMEngine(str(path), device="cpu", tensor_parallel_size=2, kv_cache_memory_gb=0.02)
    try:
        assert_same_tokens(engine.generate(prompts, GREEDY), ref, PROMPT_LENS)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def tiny_next(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_next_slots"), "qwen3_next")


def test_admission_waits_for_a_free_state_slot(tiny_next):
    engine = LLMEngine(str(tiny_next), max_num_seqs=2)
    engine.add_request([[5 + i] * 20 for i in range(3)], GREEDY)
    engine.step()
    kv, scheduler = engine.core.kv, engine.core.scheduler
    assert scheduler.num_running == 2 and scheduler.num_waiting == 1
    assert kv.num_free_state_slots == 0 and not kv.can_allocate(scheduler.waiting[0], 1)
    assert sorted(seq.state_slot for seq in scheduler.running) == [0, 1]


def test_abort_frees_the_state_slot(tiny_next):
    engine = LLMEngine(str(tiny_next), max_num_seqs=2)
    first, _ = engine.add_request([list(range(3, 40)), list(range(50, 60))], GREEDY)
    engine.step()
    assert engine.core.kv.num_free_state_slots == 0
    engine.abort_request(first)
    assert engine.core.kv.num_free_state_slots == 1
    while not engine.is_finished():
        engine.step()
    _all_returned(engine)


def test_draft_model_speculation_is_refused(tiny_next):
    """MTP and n-gram drafts are verified with per-token state rollback (tests/spec_decode/test_hybrid_mtp.py);
    a separate draft model is not supported on these models."""
    with pytest.raises(ValueError, match="--method draft is not supported for models with linear-attention"):
        LLMEngine(str(tiny_next), method="draft", draft_model=str(tiny_next), num_speculative_tokens=2)
