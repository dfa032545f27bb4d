"""Token-for-token parity with HF transformers (greedy) on tiny random models, in every
scheduling regime: defaults, chunked prefill, prefix caching, forced preemption, max_num_seqs=2."""
import pytest
import torch

from atom_core import LLMEngine, SamplingParams
from tests.models.harness import assert_same_tokens, hf_greedy, random_prompts

PROMPT_LENS = [1, 7, 20, 50, 100, 150, 220, 300]
MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _hf_greedy(path, prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return hf_greedy(model, prompts, MAX_TOKENS)


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3_moe", "mixtral", "glm4_moe"])
def model_and_ref(request):
    path = request.getfixturevalue(f"tiny_{request.param}")
    vocab = __import__("json").load(open(path / "config.json"))["vocab_size"]
    prompts = random_prompts(vocab, PROMPT_LENS)
    shared = random_prompts(vocab, PROMPT_LENS, shared_prefix=100)
    return path, prompts, _hf_greedy(path, prompts), shared, _hf_greedy(path, shared)


def test_defaults(model_and_ref):
    path, prompts, ref, _, _ = model_and_ref
    engine = LLMEngine(str(path))
    assert_same_tokens(engine.generate(prompts, GREEDY), ref, PROMPT_LENS)
    assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks


def test_chunked_prefill(model_and_ref):
    path, prompts, ref, _, _ = model_and_ref
    engine = LLMEngine(str(path), max_num_batched_tokens=64)
    assert_same_tokens(engine.generate(prompts, GREEDY), ref, PROMPT_LENS)
    assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks


def test_prefix_caching_with_shared_prefixes(model_and_ref):
    path, _, _, shared, shared_ref = model_and_ref
    engine = LLMEngine(str(path), enable_prefix_caching=True)
    first = engine.generate([shared[0]], GREEDY)  # computes and caches the shared prefix
    assert first[0]["token_ids"] == shared_ref[0]
    assert_same_tokens(engine.generate(shared, GREEDY), shared_ref, PROMPT_LENS)
    assert engine.core.kv.num_hit_tokens >= 7 * 96  # 6 full blocks of the 100-token prefix, per later prompt
    assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks


def test_preemption_keeps_outputs(model_and_ref):
    path, prompts, ref, _, _ = model_and_ref
    engine = LLMEngine(str(path), num_kv_blocks=24, max_model_len=340, enable_prefix_caching=False)
    assert_same_tokens(engine.generate(prompts, GREEDY), ref, PROMPT_LENS)
    assert engine.core.scheduler.num_preemptions > 0
    assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks


def test_preemption_with_prefix_caching(model_and_ref):
    path, prompts, ref, _, _ = model_and_ref
    engine = LLMEngine(str(path), num_kv_blocks=24, max_model_len=340, max_num_batched_tokens=64)
    assert_same_tokens(engine.generate(prompts, GREEDY), ref, PROMPT_LENS)
    assert engine.core.scheduler.num_preemptions > 0
    assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks


def test_max_num_seqs_two(model_and_ref):
    path, prompts, ref, _, _ = model_and_ref
    engine = LLMEngine(str(path), max_num_seqs=2)
    assert_same_tokens(engine.generate(prompts, GREEDY), ref, PROMPT_LENS)


def test_prompt_logprobs_match_hf_logits(model_and_ref):
    from transformers import AutoModelForCausalLM

    path, prompts, _, _, _ = model_and_ref
    prompt = prompts[5]
    engine = LLMEngine(str(path), max_num_batched_tokens=64)  # chunked: logprobs span several steps
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        logp = model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    expected = logp[:-1].gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
    got = torch.tensor([entry[0] for entry in out["prompt_logprobs"][1:]])
    assert out["prompt_logprobs"][0] is None and len(got) == len(prompt) - 1
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
