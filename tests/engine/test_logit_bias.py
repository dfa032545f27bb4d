"""logit_bias (OpenAI's): each request's {token id: bias} added to its logits before every sample.

Greedy output with biases equals HF generate with the same biases (its `sequence_bias` over one-token
sequences) in one batch with unbiased requests, under chunked prefill and max_num_seqs=2, and through
multi-step windows; speculative decoding keeps it exact; sampling follows softmax(logits + bias);
bad biases are clear errors naming the field."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from atom_core import LLMEngine, SamplingParams
from atom_core.model_ops.sampler import Sampler, SamplingBatch

MAX_TOKENS = 12
VOCAB = 390  # the tiny llama's ids are below 397


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (23, 9, 41, 14)]


def biases(plain: list[list[int]]) -> list[dict[int, float] | None]:
    """Per prompt: ban the token plain greedy picks first (and a bonus for another), force one token,
    none, and a mild nudge that changes some picks."""
    return [{plain[0][0]: -100.0, 17: 2.5}, {42: 100.0}, None, {t: 1.5 for t in plain[3][:4]}]


def hf_biased_greedy(path, ps: list[list[int]], bias: list[dict[int, float] | None]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    for p, b in zip(ps, bias):
        kwargs = {"sequence_bias": {(t,): v for t, v in b.items()}} if b else {}
        ids = model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                             do_sample=False, pad_token_id=0, **kwargs)
        out.append(ids[0, len(p):].tolist())
    return out


@pytest.fixture(scope="module")
def reference(tiny_llama):
    ps = prompts()
    plain = [o["token_ids"] for o in LLMEngine(str(tiny_llama)).generate(
        ps, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    bias = biases(plain)
    expected = hf_biased_greedy(tiny_llama, ps, bias)
    assert expected[1] == [42] * MAX_TOKENS and expected[0][0] != plain[0][0] and expected[2] == plain[2]
    assert expected[3] != plain[3]  # the nudge matters
    return ps, bias, expected


def _params(bias: dict[int, float] | None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias=bias)


@pytest.mark.parametrize("options", [
    {}, {"max_num_batched_tokens": 16}, {"max_num_seqs": 2}, {"num_scheduler_steps": 4},
    {"method": "ngram", "num_speculative_tokens": 3, "ngram_min": 1, "ngram_max": 3},
], ids=["defaults", "chunked", "two_seqs", "windows", "ngram"])
def test_greedy_with_biases_equals_hf(tiny_llama, reference, options):
    ps, bias, expected = reference
    engine = LLMEngine(str(tiny_llama), **options)
    outs = engine.generate(ps, [_params(b) for b in bias])
    assert [o["token_ids"] for o in outs] == expected


def test_sampling_follows_softmax_of_the_biased_logits():
    torch.manual_seed(0)  # the sampler's unseeded noise: one fixed draw
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(N := 20000, 1)
    bias = {0: -1.5, 3: 2.0}
    batch = SamplingBatch(temperatures=torch.ones(N), top_ks=None, top_ps=None, min_ps=None, seeds=None,
                          positions=None, all_greedy=False, any_greedy=False)
    rows = torch.arange(N).repeat_interleave(len(bias))
    tokens = torch.tensor(list(bias)).repeat(N)
    batch.logit_bias = (torch.stack([rows, tokens]), torch.tensor(list(bias.values())).repeat(N))
    counts = np.bincount(Sampler()(logits, batch).token_ids.numpy(), minlength=4)
    biased = logits[0] + torch.tensor([-1.5, 0.0, 0.0, 2.0])
    probs = torch.softmax(biased.double(), dim=-1).numpy()
    expected = probs / probs.sum() * counts.sum()
    assert chisquare(counts, expected).pvalue > 1e-3, (counts, expected)


def test_a_bias_past_the_vocabulary_is_refused_when_added(tiny_llama):
    engine = LLMEngine(str(tiny_llama))
    with pytest.raises(ValueError, match=r"invalid sampling parameter logit_bias=.*out of range \[0, \d+\): \[100000\]"):
        engine.generate([[5, 6, 7]], _params({100000: 1.0}))
    assert engine.generate([[5, 6, 7]], _params(None))[0]["token_ids"]  # nothing else was lost


@pytest.mark.parametrize("bias, message", [
    ({-1: 1.0}, "token ids must be integers >= 0, got -1"),
    ({3: 100.5}, "must be a number in [-100, 100], got 100.5"),
    ({"3": 1.0}, "token ids must be integers >= 0, got '3'"),
    ([3, 1.0], "must be a mapping of token ids to biases"),
])
def test_bad_biases_name_the_field(bias, message):
    with pytest.raises(ValueError, match="invalid sampling parameter logit_bias=") as e:
        SamplingParams(logit_bias=bias)
    assert message in str(e.value)


# ---- allowed_token_ids (vLLM's): the same seam, a mask ------------------------------------------
ALLOWED = [11, 42, 97, 250]


def _allowed(ids: list[int] | None, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, allowed_token_ids=ids, **({"temperature": 0} | kw))


@pytest.fixture(scope="module")
def allowed_reference(tiny_llama):
    """HF greedy with every other id suppressed, for the first two prompts; the others unconstrained."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    suppress = [t for t in range(model.config.vocab_size) if t not in ALLOWED]
    ps, out = prompts(), []
    for i, p in enumerate(ps):
        kwargs = {"suppress_tokens": suppress} if i < 2 else {}
        ids = model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                             pad_token_id=0, **kwargs)
        out.append(ids[0, len(p):].tolist())
    assert set(out[0]) <= set(ALLOWED) and len(set(out[0]) | set(out[1])) > 1
    return ps, out


@pytest.mark.parametrize("options", [{}, {"max_num_seqs": 2},
                                     {"method": "ngram", "num_speculative_tokens": 3, "ngram_min": 1, "ngram_max": 3}],
                         ids=["defaults", "two_seqs", "ngram"])
def test_allowed_token_ids_greedy_equals_hf_suppressing_the_rest(tiny_llama, allowed_reference, options):
    ps, expected = allowed_reference
    params = [_allowed(ALLOWED), _allowed(ALLOWED), _allowed(None), _allowed(None)]
    outs = LLMEngine(str(tiny_llama), **options).generate(ps, params)
    assert [o["token_ids"] for o in outs] == expected


def test_allowed_token_ids_bound_sampling_and_bad_ones_name_the_field(tiny_llama):
    engine = LLMEngine(str(tiny_llama))
    out = engine.generate([prompts()[0]], _allowed(ALLOWED[:2], temperature=1.0, seed=1))[0]["token_ids"]
    assert set(out) <= set(ALLOWED[:2]) and len(out) == MAX_TOKENS
    with pytest.raises(ValueError, match=r"invalid sampling parameter allowed_token_ids=.*out of range"):
        engine.generate([[5, 6]], _allowed([3, 10**6]))
    for bad in ([], [-1], ["7"]):
        with pytest.raises(ValueError, match="allowed_token_ids=.*must be a non-empty list of token ids >= 0"):
            SamplingParams(allowed_token_ids=bad)
