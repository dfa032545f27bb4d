"""Prompt samplers: lengths measured with real (locally trained) tokenizers, seeds, file formats."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from atom_core.bench.datasets import (
    DatasetConfig,
    length_tolerance,
    sample_custom,
    sample_prefix_repetition,
    sample_random,
    sample_requests,
    sample_sharegpt,
)


def _server_count(tokenizer, prompt: str) -> int:
    return len(tokenizer(prompt).input_ids)


class TestRandom:
    @pytest.mark.parametrize("tok_name", ["byte_bpe", "llama_style"])
    @pytest.mark.parametrize("input_len", [5, 64, 700])
    def test_input_len_is_exact_within_tolerance(self, request, tok_name, input_len):
        tokenizer = request.getfixturevalue(tok_name)
        reqs = sample_random(tokenizer, 30, input_len, 16, seed=3)
        measured = [_server_count(tokenizer, r.prompt) for r in reqs]
        assert [r.prompt_len for r in reqs] == measured
        assert all(abs(n - input_len) <= length_tolerance(input_len) for n in measured)
        # In practice the fitting is exact; the tolerance is the documented guarantee.
        assert sum(n == input_len for n in measured) >= 0.9 * len(measured)
        assert all(r.expected_output_len == 16 for r in reqs)

    def test_range_ratio_spreads_lengths_in_bounds(self, byte_bpe):
        reqs = sample_random(byte_bpe, 60, 200, 100, range_ratio=0.5, seed=0)
        ins, outs = [r.prompt_len for r in reqs], [r.expected_output_len for r in reqs]
        tol = length_tolerance(300)
        assert all(100 - tol <= n <= 300 + tol for n in ins)
        assert all(50 <= n <= 150 for n in outs)
        assert len(set(ins)) > 10 and len(set(outs)) > 10

    def test_prefix_is_shared_and_counted(self, llama_style):
        reqs = sample_random(llama_style, 10, 120, 8, prefix_len=50, seed=1)
        prefix = reqs[0].prompt[:60]
        assert all(r.prompt.startswith(prefix) for r in reqs)
        assert all(abs(r.prompt_len - 120) <= length_tolerance(120) for r in reqs)

    def test_seed_reproduces_prompts(self, byte_bpe):
        a = sample_random(byte_bpe, 8, 50, 10, range_ratio=0.3, seed=7)
        b = sample_random(byte_bpe, 8, 50, 10, range_ratio=0.3, seed=7)
        c = sample_random(byte_bpe, 8, 50, 10, range_ratio=0.3, seed=8)
        assert a == b
        assert [r.prompt for r in a] != [r.prompt for r in c]

    def test_chat_template_counts_template_tokens(self, llama_style):
        reqs = sample_random(llama_style, 10, 60, 8, seed=2, apply_chat_template=True)
        for r in reqs:
            assert r.prompt.startswith("<s><|user|>\n") and r.prompt.endswith("<|assistant|>\n")
            # A templated prompt already holds BOS; the server tokenizes it without adding another.
            assert r.prompt_len == len(llama_style(r.prompt, add_special_tokens=False).input_ids)
            assert abs(r.prompt_len - 60) <= length_tolerance(60)

    def test_chat_template_without_template_is_an_error(self, byte_bpe):
        with pytest.raises(ValueError, match="no chat template"):
            sample_random(byte_bpe, 2, 20, 8, apply_chat_template=True)


def _conversation(human: str, gpt: str) -> dict:
    return {"id": "x", "conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}]}


class TestShareGPT:
    @pytest.fixture
    def sharegpt_file(self, tmp_path):
        long_text = "hello world " * 30
        data = [
            _conversation(f"Question number {i}: tell me about the world and the tok.", long_text)
            for i in range(5)
        ]
        data.append(_conversation("hi", long_text))  # prompt too short: skipped
        data.append({"id": "single", "conversations": [{"from": "human", "value": "only one turn here ok"}]})
        data.append(_conversation("A fine prompt with a short reply here.", "ok"))  # reply too short
        path = tmp_path / "sharegpt.json"
        path.write_text(json.dumps(data))
        return path

    def test_uses_reply_length_and_skips_invalid(self, byte_bpe, sharegpt_file):
        reqs = sample_sharegpt(byte_bpe, sharegpt_file, 5, seed=0)
        assert len(reqs) == 5
        assert all(r.prompt.startswith("Question number") for r in reqs)
        reply_len = len(byte_bpe("hello world " * 30).input_ids)
        assert all(r.expected_output_len == reply_len for r in reqs)
        assert all(r.prompt_len == _server_count(byte_bpe, r.prompt) for r in reqs)

    def test_fixed_output_len_and_oversampling(self, byte_bpe, sharegpt_file):
        reqs = sample_sharegpt(byte_bpe, sharegpt_file, 12, output_len=7, seed=0)
        assert len(reqs) == 12
        assert all(r.expected_output_len == 7 for r in reqs)
        # With a fixed output length, the short-reply conversation qualifies too.
        assert any(r.prompt.startswith("A fine prompt") for r in reqs)

    def test_seed_controls_order(self, byte_bpe, sharegpt_file):
        a = sample_sharegpt(byte_bpe, sharegpt_file, 5, seed=1)
        assert a == sample_sharegpt(byte_bpe, sharegpt_file, 5, seed=1)
        orders = {tuple(r.prompt for r in sample_sharegpt(byte_bpe, sharegpt_file, 5, seed=s)) for s in range(6)}
        assert len(orders) > 1

    def test_bad_file_is_a_clear_error(self, byte_bpe, tmp_path):
        bad = tmp_path / "bad.json"
        bad.write_text("{not json")
        with pytest.raises(ValueError, match="cannot read ShareGPT file"):
            sample_sharegpt(byte_bpe, bad, 3)


class TestCustom:
    def test_reads_prompts_and_output_lens(self, llama_style, tmp_path):
        path = tmp_path / "p.jsonl"
        rows = [{"prompt": "first prompt here", "output_len": 5}, {"prompt": "second one"}, {"prompt": "third"}]
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
        reqs = sample_custom(llama_style, path, 3, output_len=11)
        assert [r.prompt for r in reqs] == ["first prompt here", "second one", "third"]
        assert [r.expected_output_len for r in reqs] == [5, 11, 11]
        assert [r.prompt_len for r in reqs] == [_server_count(llama_style, r.prompt) for r in reqs]
        assert len(sample_custom(llama_style, path, 7)) == 7  # oversampled

    @pytest.mark.parametrize(
        "line, match",
        [("{oops", "not valid JSON"), ('{"text": "x"}', 'needs a string "prompt"'),
         ('{"prompt": "x", "output_len": 0}', "positive integer")],
    )
    def test_bad_lines_name_the_line(self, byte_bpe, tmp_path, line, match):
        path = tmp_path / "p.jsonl"
        path.write_text('{"prompt": "fine"}\n' + line + "\n")
        with pytest.raises(ValueError, match=f"p.jsonl:2: .*{match}"):
            sample_custom(byte_bpe, path, 2)


class TestPrefixRepetition:
    def test_prompts_share_few_prefixes(self, byte_bpe):
        reqs = sample_prefix_repetition(byte_bpe, 14, prefix_len=60, suffix_len=20, num_prefixes=3, output_len=9, seed=0)
        assert len(reqs) == 14
        heads = Counter(r.prompt[:40] for r in reqs)
        assert len(heads) == 3 and sorted(heads.values()) == [4, 5, 5]
        assert all(r.expected_output_len == 9 for r in reqs)
        assert all(abs(r.prompt_len - 80) <= length_tolerance(80) for r in reqs)
        assert all(r.prompt_len == _server_count(byte_bpe, r.prompt) for r in reqs)
        assert reqs == sample_prefix_repetition(byte_bpe, 14, 60, 20, 3, 9, seed=0)

    def test_more_prefixes_than_prompts_is_an_error(self, byte_bpe):
        with pytest.raises(ValueError, match="must not exceed --num-prompts"):
            sample_prefix_repetition(byte_bpe, 2, num_prefixes=3)


class TestDatasetConfig:
    @pytest.mark.parametrize(
        "kwargs, match",
        [
            ({"name": "nope"}, "unknown dataset 'nope'; expected one of: random, sharegpt"),
            ({"name": "sharegpt"}, "needs --dataset-path"),
            ({"name": "custom", "path": "/no/such/file.jsonl"}, "does not exist"),
            ({"random_range_ratio": 1.0}, "--random-range-ratio"),
            ({"random_input_len": 0}, "--random-input-len must be >= 1"),
            ({"random_prefix_len": -1}, "--random-prefix-len must be >= 0"),
        ],
    )
    def test_rejects_bad_values(self, kwargs, match):
        with pytest.raises(ValueError, match=match):
            DatasetConfig(**kwargs)

    def test_dispatches_by_name(self, byte_bpe):
        cfg = DatasetConfig(name="prefix-repetition", prefix_repetition_prefix_len=10,
                            prefix_repetition_suffix_len=5, prefix_repetition_num_prefixes=2)
        assert len(sample_requests(cfg, byte_bpe, 4, seed=0)) == 4
        with pytest.raises(ValueError, match="--num-prompts must be >= 1"):
            sample_requests(DatasetConfig(), byte_bpe, 0, seed=0)
