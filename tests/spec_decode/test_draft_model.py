"""--method draft: a small model of the same tokenizer drafts greedily; its KV follows the
target's block tables (scratch blocks past them). With the target itself as the draft every
draft is accepted, which checks the draft's KV bookkeeping through preemption and chunking."""
from __future__ import annotations

import json

import pytest

from atom_core import LLMEngine, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7], [20, 21, 22, 23, 20, 21, 22, 23, 20], list(range(30, 60))]
GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(tiny_llama):
    return [o["token_ids"] for o in LLMEngine(str(tiny_llama)).generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    from tests.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("draft"), "llama", seed=1, num_layers=1)


@pytest.mark.parametrize("options", [
    {},
    {"block_size": 4, "num_kv_blocks": 30, "max_model_len": 80},  # preemption
    {"max_num_batched_tokens": 8, "max_num_seqs": 1},  # chunked prefill, one scratch slot
], ids=["default", "preempt", "chunked-one-seq"])
def test_the_target_as_its_own_draft_is_always_right(tiny_llama, plain, options):
    engine = LLMEngine(str(tiny_llama), method="draft", draft_model=str(tiny_llama), num_speculative_tokens=3,
                       **options)
    assert [o["token_ids"] for o in engine.generate(PROMPTS, GREEDY)] == plain
    stats = engine.spec_decode_stats()
    assert stats["num_drafts"] > 20 and stats["num_accepted_tokens"] == stats["num_draft_tokens"]
    assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks
    if "num_kv_blocks" in options:
        assert engine.core.scheduler.num_preemptions > 0


def test_another_draft_model_keeps_greedy_output(tiny_llama, plain, other_draft):
    engine = LLMEngine(str(tiny_llama), method="draft", draft_model=str(other_draft), num_speculative_tokens=4)
    assert [o["token_ids"] for o in engine.generate(PROMPTS, GREEDY)] == plain
    stats = engine.spec_decode_stats()
    assert stats["num_drafts"] > 0 and stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True)
    again = LLMEngine(str(tiny_llama), method="draft", draft_model=str(other_draft), num_speculative_tokens=4)
    tokens = lambda e: [o["token_ids"] for o in e.generate(PROMPTS, seeded)]  # noqa: E731
    assert tokens(engine) == tokens(again)  # seeded sampling is reproducible with a draft model


def test_a_draft_with_another_vocabulary_fails_at_start(tiny_llama, tmp_path):
    import shutil

    shutil.copytree(tiny_llama, tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    config["vocab_size"] += 1
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        LLMEngine(str(tiny_llama), method="draft", draft_model=str(tmp_path / "d"), num_speculative_tokens=2)


@pytest.mark.parametrize("options,match", [
    ({"method": "draft", "num_speculative_tokens": 2}, "a draft model directory is required"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "/d"}, "a draft model directory is required"),
    ({"draft_model": "/d"}, "needs a speculative method"),
    ({"method": "draft", "num_speculative_tokens": 2, "draft_model": "/d", "ngram_max": 3}, "method ngram only"),
])
def test_bad_draft_options(options, match):
    from atom_core.config import EngineConfig

    with pytest.raises(ValueError, match=match):
        EngineConfig.from_kwargs("/m", **options)


def test_generate_command_takes_a_draft_model(tiny_llama, other_draft):
    from typer.testing import CliRunner

    from atomctl.main import app

    result = CliRunner().invoke(app, ["generate", "--model", str(tiny_llama), "--no-chat", "--max-tokens", "12",
                                      "--ignore-eos", "--method", "draft", "--draft-model", str(other_draft),
                                      "--num-speculative-tokens", "2", "hello hello hello"])
    assert result.exit_code == 0, result.output
    assert "[speculative: acceptance rate" in result.output
