"""Speculative decoding through LLMEngine on the CPU: greedy output identical to plain decoding
(and HF's) in every scheduling regime, acceptance on repetitive text, seeded reproducibility,
the sampling distribution, options and their errors."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

from atom_core import LLMEngine, SamplingParams
from atom_core.loader.model_dir import DEMO_MODEL_DIR

NGRAM = dict(method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    motif = torch.randint(3, vocab, (5,), generator=g).tolist()
    return [motif * 4, torch.randint(3, vocab, (37,), generator=g).tolist(), motif[:3] * 7 + [5],
            torch.randint(3, vocab, (9,), generator=g).tolist()]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Plain greedy tokens (checked against HF) for the prompts."""
    from transformers import AutoModelForCausalLM

    from tests.models.harness import hf_greedy

    ps = prompts(390)
    plain = [o["token_ids"] for o in LLMEngine(str(tiny_llama)).generate(ps, GREEDY)]
    hf = hf_greedy(AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval(), ps, 24)
    assert plain == hf
    return ps, plain


@pytest.mark.parametrize("options", [
    {},
    {"num_speculative_tokens": 1},
    {"async_scheduling": False, "num_speculative_tokens": 8},
    {"max_num_batched_tokens": 16},  # chunked prefill shares steps with verification
    {"max_num_seqs": 2},
    {"block_size": 4, "num_kv_blocks": 24, "max_model_len": 64},  # forces preemption
], ids=["k3", "k1", "sync-k8", "chunked", "two-seqs", "preempt"])
def test_greedy_equals_plain_decoding(tiny_llama, reference, options):
    ps, plain = reference
    engine = LLMEngine(str(tiny_llama), **{**NGRAM, **options})
    assert [o["token_ids"] for o in engine.generate(ps, GREEDY)] == plain
    stats = engine.spec_decode_stats()
    assert stats["num_drafts"] > 0 and stats["num_draft_tokens"] >= stats["num_drafts"]
    assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks
    if "num_kv_blocks" in options:
        assert engine.core.scheduler.num_preemptions > 0


def test_prefix_cache_holds_only_verified_kv(tiny_llama, reference):
    """A later request whose prompt is an earlier request's prompt + output hits the blocks
    written during speculation (rejected drafts rolled back) and still decodes exactly."""
    ps, plain = reference
    engine = LLMEngine(str(tiny_llama), block_size=4, **NGRAM)
    engine.generate(ps, GREEDY)
    followups = [p + out for p, out in zip(ps, plain)]
    expected = [o["token_ids"] for o in LLMEngine(str(tiny_llama), enable_prefix_caching=False).generate(followups, GREEDY)]
    before = engine.core.kv.num_hit_tokens
    assert [o["token_ids"] for o in engine.generate(followups, GREEDY)] == expected
    assert engine.core.kv.num_hit_tokens - before >= sum(len(f) for f in followups) - 4 * len(followups) * 2


def test_ngram_drafts_are_accepted_on_repetitive_text():
    prompt = "The 7 times table:\n7 × 1 = 7\n7 × 2 = 14\n7 × 3 ="
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = LLMEngine(str(DEMO_MODEL_DIR)).generate([prompt], params)[0]
    engine = LLMEngine(str(DEMO_MODEL_DIR), method="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=4)
    out = engine.generate([prompt], params)[0]
    assert out["token_ids"] == plain["token_ids"] and "7 × 5 = 35" in out["text"]
    stats = engine.spec_decode_stats()
    assert stats["num_accepted_tokens"] >= 10 and stats["accepted_per_position"][0] > 0


def test_seeded_sampling_is_reproducible_alone_or_batched(tiny_llama, reference):
    ps, _ = reference
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=42, max_tokens=20, ignore_eos=True)
    noisy = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    a = LLMEngine(str(tiny_llama), **NGRAM).generate([ps[0]], seeded)[0]["token_ids"]
    engine = LLMEngine(str(tiny_llama), seed=5, **NGRAM)
    b = engine.generate([ps[1], ps[0], ps[2]], [noisy, seeded, noisy])[1]["token_ids"]
    assert a == b and engine.spec_decode_stats()["num_drafts"] > 0


def test_logprobs_and_penalties_under_speculation(tiny_llama, reference):
    """Greedy with a repetition penalty and logprobs: same tokens and logprobs as plain decoding."""
    ps, _ = reference
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2, repetition_penalty=1.3)
    plain = LLMEngine(str(tiny_llama)).generate(ps, params)
    spec = LLMEngine(str(tiny_llama), **NGRAM).generate(ps, params)
    for p, s in zip(plain, spec):
        assert p["token_ids"] == s["token_ids"]
        assert np.allclose([lp[0] for lp in p["logprobs"]], [lp[0] for lp in s["logprobs"]], atol=1e-4)


@pytest.fixture(scope="module")
def tiny_vocab_model(tmp_path_factory):
    """A 2-layer Llama over 12 tokens, no tokenizer: small enough to count every outcome."""
    from tests.tiny_models import save_tiny_vocab_llama

    path = save_tiny_vocab_llama(tmp_path_factory.mktemp("tiny_vocab"), num_layers=2)
    return path


def test_sampling_distribution_matches_plain_sampling(tiny_vocab_model):
    """Chi-square (contingency) on each of the four tokens of 500 draws with and without
    speculation, on a prompt where drafts are always proposed and often accepted."""
    prompt = list(range(12)) * 2  # every token has occurred: a 1-gram always matches
    params = SamplingParams(temperature=1.0, top_k=8, max_tokens=4, ignore_eos=True)
    n = 500

    def draws(**options):
        engine = LLMEngine(str(tiny_vocab_model), max_num_seqs=n, max_num_batched_tokens=n * 30, **options)
        outs = [o["token_ids"] for o in engine.generate([prompt] * n, params)]
        return outs, engine.spec_decode_stats()

    plain, _ = draws()
    spec, stats = draws(method="ngram", num_speculative_tokens=2, ngram_min=1, ngram_max=2)
    assert stats["num_accepted_tokens"] > 40  # the test exercises accepted drafts, not just rejections
    for position in (0, 1, 2, 3):
        table = np.zeros((2, 12))
        for row, outs in enumerate((plain, spec)):
            np.add.at(table[row], [o[position] for o in outs], 1)
        table = table[:, table.sum(0) > 0]
        assert chi2_contingency(table).pvalue > 1e-3, (position, table)


class TestOptions:
    @pytest.mark.parametrize("options,match", [
        ({"method": "eagle", "num_speculative_tokens": 2}, "expected one of: ngram"),
        ({"method": "ngram"}, "required with method ngram"),
        ({"method": "ngram", "num_speculative_tokens": 9}, "between 1 and 8"),
        ({"num_speculative_tokens": 2}, "needs a speculative method"),
        ({"ngram_min": 2}, "needs a speculative method"),
        ({"method": "ngram", "num_speculative_tokens": 2, "ngram_min": 4, "ngram_max": 2}, "ngram_min <= ngram_max"),
    ])
    def test_bad_options_fail_at_start(self, options, match):
        from atom_core.config import EngineConfig

        with pytest.raises(ValueError, match=match):
            EngineConfig.from_kwargs("/m", **options)

    def test_ngram_window_defaults_as_vllm(self):
        from atom_core.config import EngineConfig

        spec = lambda **o: EngineConfig.from_kwargs("/m", method="ngram", num_speculative_tokens=2, **o).speculative
        assert spec().ngram_window == (5, 5)
        assert spec(ngram_max=3).ngram_window == (3, 3) and spec(ngram_min=2, ngram_max=4).ngram_window == (2, 4)

    def test_generate_command_prints_acceptance(self):
        from typer.testing import CliRunner

        from atomctl.main import app

        result = CliRunner().invoke(app, ["generate", "--no-chat", "--max-tokens", "20", "--method", "ngram",
                                          "--num-speculative-tokens", "3", "--ngram-min", "1", "--ngram-max", "3",
                                          "The 3 times table:\n3 × 1 = 3\n3 × 2 = 6\n3 × 3 ="])
        assert result.exit_code == 0, result.output
        assert "[speculative: acceptance rate" in result.output

    def test_generate_command_rejects_a_bad_method(self):
        from typer.testing import CliRunner

        from atomctl.main import app

        result = CliRunner().invoke(app, ["generate", "--method", "eagle", "--num-speculative-tokens", "1", "hi"])
        assert result.exit_code != 0 and "--method" in result.output and "ngram, draft, mtp" in result.output


class _EagerReplay:
    """Stands in for the verify CUDA graphs on the CPU: runs the same padded flat batch eagerly."""

    def __init__(self, model, query_len: int):
        self.model, self.query_len = model, query_len

    def can_run(self, batch_size: int) -> bool:
        return True

    def replay(self, flat):
        from atom_core.model_ops.forward_context import set_attention_metadata

        with set_attention_metadata(flat.attn):
            return self.model(flat.input_ids, flat.positions)


def test_padded_verify_layout_of_the_graphs_is_exact(tiny_llama, reference):
    """Verify steps laid out for CUDA graphs (1 + k rows per request, missing drafts padded)."""
    ps, plain = reference
    engine = LLMEngine(str(tiny_llama), **NGRAM)
    runner = engine.core.executor.runner
    dispatcher = runner.dispatcher
    dispatcher.verify = _EagerReplay(runner.model, 1 + NGRAM["num_speculative_tokens"])
    calls = []
    build = dispatcher.uses_verify_layout
    dispatcher.uses_verify_layout = lambda out, states: calls.append(build(out, states)) or calls[-1]
    assert [o["token_ids"] for o in engine.generate(ps, GREEDY)] == plain
    assert any(calls) and engine.spec_decode_stats()["num_accepted_tokens"] > 0
    assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks


def test_tensor_parallel_ranks_agree_under_speculation(tiny_llama, reference):
    """Two gloo ranks: every rank verifies and proposes for itself; their tokens must match."""
    ps, plain = reference
    sampled = [SamplingParams(temperature=0.9, top_p=0.9, seed=s, max_tokens=16, ignore_eos=True) for s in range(4)]
    single = LLMEngine(str(tiny_llama), kv_cache_memory_gb=0.02, **NGRAM).generate(ps, sampled)
    engine = LLMEngine(str(tiny_llama), tensor_parallel_size=2, kv_cache_memory_gb=0.02, **NGRAM)
    try:
        assert [o["token_ids"] for o in engine.generate(ps, GREEDY)] == plain
        assert [o["token_ids"] for o in engine.generate(ps, sampled)] == [o["token_ids"] for o in single]
        assert engine.spec_decode_stats()["num_drafts"] > 0
    finally:
        engine.shutdown()


def test_mixed_batch_with_prompt_logprobs_stop_strings_and_min_tokens(tiny_llama, reference):
    """Requests that do not draft (stop strings) or need per-row care (min_tokens, prompt
    logprobs in a step shared with verification) come out as in plain decoding."""
    ps, _ = reference
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=1),
              SamplingParams(temperature=0, max_tokens=20, min_tokens=15),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=["zzzz"])]
    plain = LLMEngine(str(tiny_llama), max_num_batched_tokens=24).generate(ps, params)
    engine = LLMEngine(str(tiny_llama), max_num_batched_tokens=24, **NGRAM)
    spec = engine.generate(ps, params)
    for p, s in zip(plain, spec):
        assert p["token_ids"] == s["token_ids"]
    lp = lambda o: [None if e is None else e[0] for e in o["prompt_logprobs"]]  # noqa: E731
    assert np.allclose(lp(plain[1])[1:], lp(spec[1])[1:], atol=1e-4)
    assert engine.spec_decode_stats()["num_drafts"] > 0
