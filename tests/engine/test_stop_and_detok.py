"""Stopping (stop strings, stop token ids, EOS, max_tokens, max_model_len, min_tokens),
incremental detokenization and streaming, on the real LLMEngine with the tiny random Llama.

Stop cases are derived from what the model greedily emits, so they hold for any weights.
"""
from __future__ import annotations

import random

import pytest

from atom_core import LLMEngine, SamplingParams
from atom_core.engine.detokenizer import IncrementalDetokenizer
from tests.tiny_models import copy_model_with

PROMPT = "naïve café 🚀"
N = 20  # greedy reference length


def greedy(max_tokens: int = N, **kw) -> SamplingParams:
    kw.setdefault("ignore_eos", True)
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    # Single steps: the streaming tests count one callback per token (windows deliver several).
    return LLMEngine(str(tiny_llama), device="cpu", num_kv_blocks=128, num_scheduler_steps=1)


@pytest.fixture(scope="module")
def tok(engine):
    return engine.tokenizer


@pytest.fixture(scope="module")
def ref(engine):
    """The greedy continuation of PROMPT: token ids, text, and each token's own text."""
    out = engine.generate([PROMPT], greedy())[0]
    pieces = [decode(engine.tokenizer, out["token_ids"][: i + 1]) for i in range(N)]
    assert out["text"] == pieces[-1]
    return out["token_ids"], out["text"], pieces


def decode(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)  # as the engine does by default


def assert_engine_clean(engine: LLMEngine) -> None:
    assert engine.is_finished()
    assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks
    assert not engine.outputs.states


def first_new_token(ids: list[int], start: int = 2) -> int:
    """Index k >= start of a token that does not occur before k."""
    for k in range(start, len(ids)):
        if ids[k] not in ids[:k]:
            return k
    raise AssertionError(f"no fresh token in {ids}")


def spanning_stop(text: str, prefix_texts: list[str]) -> tuple[str, int, int]:
    """A 3-4 char printable stop string that starts in token j and ends in token j + 1, first
    occurring there: (stop, index in text, j + 1)."""
    for j in range(1, len(prefix_texts) - 1):
        a, b = len(prefix_texts[j - 1]), len(prefix_texts[j])  # token j covers text[a:b]
        for left in (2, 1):
            for right in (2, 1):
                start, end = b - left, b + right
                stop = text[start:end]
                if start > a - 1 and start > 0 and stop.isascii() and stop.isprintable() and \
                        end <= len(prefix_texts[j + 1]) and text.find(stop) == start and len(stop) >= 2:
                    return stop, start, j + 1
    raise AssertionError(f"no usable stop string in {text!r}")


class TestStopStrings:
    def test_output_is_truncated_before_the_stop_string(self, engine, ref):
        ids, text, pieces = ref
        stop, idx, last_tok = spanning_stop(text, pieces)
        out = engine.generate([PROMPT], greedy(stop=[stop]))[0]
        assert out["text"] == text[:idx]
        assert out["finish_reason"] == "stop"
        assert out["token_ids"] == ids[: last_tok + 1]  # ends with the token completing the stop
        assert_engine_clean(engine)

    def test_include_stop_str_in_output(self, engine, ref):
        ids, text, pieces = ref
        stop, idx, _ = spanning_stop(text, pieces)
        out = engine.generate([PROMPT], greedy(stop=[stop], include_stop_str_in_output=True))[0]
        assert out["text"] == text[: idx + len(stop)]
        assert out["finish_reason"] == "stop"

    def test_earliest_of_several_stop_strings_wins(self, engine, ref):
        ids, text, pieces = ref
        stop, idx, _ = spanning_stop(text, pieces)
        later = text[idx + len(stop) + 2 : idx + len(stop) + 5]
        assert later and text.find(later) > idx
        out = engine.generate([PROMPT], greedy(stop=[later, stop, "never-there"]))[0]
        assert out["text"] == text[:idx]

    def test_stop_string_only_in_the_prompt_does_not_stop(self, engine, ref):
        ids, text, _ = ref
        assert "café" not in text
        out = engine.generate([PROMPT], greedy(stop=["café"]))[0]
        assert out["token_ids"] == ids and out["finish_reason"] == "length"

    def test_stopping_one_request_leaves_the_others_running(self, engine, ref):
        ids, text, pieces = ref
        stop, idx, _ = spanning_stop(text, pieces)
        outs = engine.generate([PROMPT, PROMPT], [greedy(stop=[stop]), greedy()])
        assert outs[0]["text"] == text[:idx]
        assert outs[1]["token_ids"] == ids
        assert_engine_clean(engine)


class TestStopTokenIds:
    def test_stops_on_the_token_and_leaves_it_out_of_the_text(self, engine, tok, ref):
        ids, text, _ = ref
        k = first_new_token(ids)
        out = engine.generate([PROMPT], greedy(stop_token_ids=[ids[k]]))[0]
        assert out["finish_reason"] == "stop"
        assert out["token_ids"] == ids[: k + 1]
        assert out["text"] == decode(tok, ids[:k])
        same_len = engine.generate([PROMPT], greedy(max_tokens=k))[0]
        assert out["text"] == same_len["text"]

    def test_min_tokens_suppresses_stop_token_ids(self, engine, ref):
        ids, _, _ = ref
        k = first_new_token(ids)
        out = engine.generate([PROMPT], greedy(stop_token_ids=[ids[k]], min_tokens=k + 3))[0]
        assert ids[k] not in out["token_ids"][: k + 3]
        assert len(out["token_ids"]) >= k + 3
        assert out["token_ids"][:k] == ids[:k]  # unchanged where the stop token was not the argmax


class TestLength:
    def test_max_tokens_gives_finish_reason_length(self, engine, ref):
        out = engine.generate([PROMPT], greedy(max_tokens=5))[0]
        assert out["finish_reason"] == "length"
        assert out["num_tokens_output"] == 5 and out["token_ids"] == ref[0][:5]

    def test_max_model_len_caps_a_request_without_max_tokens(self, tiny_llama, tok):
        capped = LLMEngine(str(tiny_llama), device="cpu", num_kv_blocks=16, max_model_len=16)
        prompt = tok.encode("The quick brown fox jumps")
        out = capped.generate([prompt], greedy(max_tokens=None))[0]
        assert out["finish_reason"] == "length"
        assert out["num_tokens_input"] + out["num_tokens_output"] == 16
        assert_engine_clean(capped)


class TestEos:
    @pytest.fixture(scope="class")
    @classmethod
    def eos_case(cls, tiny_llama, tmp_path_factory, ref):
        """The tiny model with its generation_config EOS set to a token it greedily emits at k."""
        ids, _, _ = ref
        k = first_new_token(ids)
        path = copy_model_with(tiny_llama, tmp_path_factory.mktemp("eos_model") / "m", "generation_config.json",
                               eos_token_id=ids[k])
        eng = LLMEngine(str(path), device="cpu", num_kv_blocks=64)
        assert eng.core.files.eos_token_ids == {ids[k]}
        return eng, ids, k

    def test_eos_stops_and_is_left_out_of_the_text(self, eos_case, tok):
        eng, ids, k = eos_case
        out = eng.generate([PROMPT], greedy(ignore_eos=False))[0]
        assert out["finish_reason"] == "stop"
        assert out["token_ids"] == ids[: k + 1]
        assert out["text"] == decode(tok, ids[:k])
        assert_engine_clean(eng)

    def test_ignore_eos_runs_to_max_tokens(self, eos_case):
        eng, ids, _ = eos_case
        out = eng.generate([PROMPT], greedy(ignore_eos=True))[0]
        assert out["finish_reason"] == "length" and out["token_ids"] == ids

    def test_min_tokens_holds_eos_back(self, eos_case):
        eng, ids, k = eos_case
        out = eng.generate([PROMPT], greedy(ignore_eos=False, min_tokens=k + 2))[0]
        assert ids[k] not in out["token_ids"][: k + 2]
        assert out["token_ids"][:k] == ids[:k]
        assert len(out["token_ids"]) >= k + 2
        if out["finish_reason"] == "stop":
            assert out["token_ids"][-1] == ids[k]


class TestIncrementalDetokenizer:
    TEXTS = [
        "naïve café résumé — 東京 ✓ emoji 🚀 and 😀 multi-byte text",
        "中文字符 Ωμέγα 👩‍👩‍👧 ñ",  # not in the tokenizer's corpus: split into raw bytes
        "🚀🚀🚀 ééé 東京東京 ✓✓",
        "plain ascii, then 😀",
    ]

    @pytest.mark.parametrize("text", TEXTS)
    @pytest.mark.parametrize("prompt", ["", "Hello", "東京 🚀"])
    def test_token_by_token_equals_decode_of_all(self, tok, text, prompt):
        ids = tok.encode(text)
        detok = IncrementalDetokenizer(tok, tok.encode(prompt))
        deltas = [detok.add_tokens([t]) for t in ids]
        out = "".join(deltas) + detok.flush()
        assert out == tok.decode(ids) == text
        assert not any("\ufffd" in d for d in deltas), "an incomplete character leaked"

    def test_split_characters_wait_for_their_last_byte(self, tok):
        ids = tok.encode("中")
        assert len(ids) > 1, "the character should be split across byte tokens"
        detok = IncrementalDetokenizer(tok, [])
        assert [detok.add_tokens([t]) for t in ids] == [""] * (len(ids) - 1) + ["中"]

    def test_random_token_streams_equal_decode_of_all(self, tok):
        # what a random model emits: stray continuation bytes, cut characters, special tokens
        rng = random.Random(0)
        prompt = tok.encode("Hello 東京")
        for _ in range(100):
            ids = [rng.randrange(len(tok)) for _ in range(24)]
            detok = IncrementalDetokenizer(tok, prompt)
            out = "".join(detok.add_tokens([t]) for t in ids) + detok.flush()
            assert out == decode(tok, ids)

    def test_special_tokens_are_skipped(self, tok):
        ids = tok.encode("Hello") + [tok.convert_tokens_to_ids("<|im_end|>")] + tok.encode(" world")
        detok = IncrementalDetokenizer(tok, [])
        assert "".join(detok.add_tokens([t]) for t in ids) + detok.flush() == "Hello world"


class TestStreaming:
    def _stream(self, engine, prompts, params):
        deltas: dict[str, list[str]] = {}
        ids: dict[str, list[int]] = {}
        calls: dict[str, int] = {}

        def on_token(state, new_ids, new_text):
            rid = state["request_id"]
            deltas.setdefault(rid, []).append(new_text)
            ids.setdefault(rid, []).extend(new_ids)
            calls[rid] = calls.get(rid, 0) + 1

        rids = engine.add_request(prompts, params, stream_callback=on_token)
        final = {}
        while not engine.is_finished():
            for state in engine.step():
                if state.finished:
                    final[state.request_id] = state.as_dict()
        return [(deltas[r], ids[r], calls[r], final[r]) for r in rids]

    def test_windowed_steps_stream_the_same_text_in_fewer_callbacks(self, tiny_llama, ref):
        ids, text, _ = ref
        windowed = LLMEngine(str(tiny_llama), device="cpu", num_kv_blocks=128, num_scheduler_steps=4)
        [(deltas, streamed_ids, calls, final)] = self._stream(windowed, [PROMPT], greedy())
        assert "".join(deltas) == final["text"] == text and streamed_ids == ids
        assert 1 < calls < N

    def test_deltas_concatenate_to_the_final_text(self, engine, ref):
        ids, text, _ = ref
        [(deltas, streamed_ids, calls, final)] = self._stream(engine, [PROMPT], greedy())
        assert "".join(deltas) == final["text"] == text
        assert streamed_ids == final["token_ids"] == ids
        assert calls == N  # one callback per new token
        assert sum(1 for d in deltas if d) > N // 2, "text was not streamed as it came"

    def test_multi_byte_output_streams_without_replacement_chars(self, engine, tok):
        # A token-id prompt that makes the model continue with split characters is not
        # guaranteed, so stream a batch and check the text invariant on every request.
        prompts = ["東京 🚀", "😀 😀", "résumé —", "Hello"]
        for deltas, _, _, final in self._stream(engine, prompts, greedy(max_tokens=12)):
            assert "".join(deltas) == final["text"] == decode(tok, final["token_ids"])

    def test_partial_stop_string_is_held_back(self, engine, ref):
        ids, text, pieces = ref
        stop, idx, last_tok = spanning_stop(text, pieces)
        [(deltas, _, _, final)] = self._stream(engine, [PROMPT], greedy(stop=[stop]))
        assert final["text"] == text[:idx]
        # the stop string's first chars arrived one token before it completed; none leaked
        assert "".join(deltas) == text[:idx]
        streamed = ""
        for d in deltas:
            streamed += d
            assert text.startswith(streamed) and len(streamed) <= idx

    def test_include_stop_str_streams_the_stop_string(self, engine, ref):
        ids, text, pieces = ref
        stop, idx, _ = spanning_stop(text, pieces)
        [(deltas, _, _, final)] = self._stream(engine, [PROMPT], greedy(stop=[stop], include_stop_str_in_output=True))
        assert "".join(deltas) == final["text"] == text[: idx + len(stop)]

    def test_held_back_text_is_flushed_when_the_request_ends_by_length(self, engine, ref):
        ids, text, _ = ref
        [(deltas, _, _, final)] = self._stream(engine, [PROMPT], greedy(stop=["zzzq-never-appears"]))
        assert final["finish_reason"] == "length"
        assert "".join(deltas) == final["text"] == text
