"""Pure protocol pieces: request models -> SamplingParams, error mapping, logprob shapes, metrics."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from atom_core.server.logprobs import LogprobFormatter
from atom_core.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    validation_error_to_api_error,
)

CHAT = [{"role": "user", "content": "hi"}]


def api_error_of(model, **body) -> APIError:
    with pytest.raises(ValidationError) as e:
        model(**body)
    return validation_error_to_api_error(e.value.errors())


class TestCompletionRequest:
    @pytest.mark.parametrize("prompt, expected", [
        ("a", ["a"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]]),
    ])
    def test_prompt_forms(self, prompt, expected):
        assert CompletionRequest(prompt=prompt).prompts == expected

    def test_defaults_to_16_tokens(self):
        assert CompletionRequest(prompt="a").to_sampling_params(0).max_tokens == 16

    def test_seed_is_offset_per_choice(self):
        req = CompletionRequest(prompt="a", n=3, seed=10)
        assert [req.to_sampling_params(j).seed for j in range(3)] == [10, 11, 12]
        assert CompletionRequest(prompt="a", n=2).to_sampling_params(1).seed is None

    def test_echo_with_logprobs_asks_for_prompt_logprobs(self):
        assert CompletionRequest(prompt="a", echo=True, logprobs=2).to_sampling_params(0).prompt_logprobs == 2
        assert CompletionRequest(prompt="a", logprobs=2).to_sampling_params(0).prompt_logprobs is None

    def test_bools_are_not_token_ids(self):
        assert api_error_of(CompletionRequest, prompt=[True, False]).param == "prompt"


class TestChatRequest:
    def test_max_completion_tokens_wins(self):
        req = ChatCompletionRequest(messages=CHAT, max_tokens=5, max_completion_tokens=7)
        assert req.to_sampling_params(0).max_tokens == 7

    def test_logprobs_mapping(self):
        assert ChatCompletionRequest(messages=CHAT).to_sampling_params(0).logprobs is None
        assert ChatCompletionRequest(messages=CHAT, logprobs=True).to_sampling_params(0).logprobs == 0
        assert ChatCompletionRequest(messages=CHAT, logprobs=True, top_logprobs=4).to_sampling_params(0).logprobs == 4

    def test_text_parts_are_joined_for_the_template(self):
        req = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                         {"type": "text", "text": "b"}]}])
        assert req.messages[0].for_template() == {"role": "user", "content": "ab"}

    @pytest.mark.parametrize("body, param", [
        ({"n": 0}, "n"), ({"tools": [{"type": "function"}]}, "tools.0.function"), ({"top_logprobs": 2}, "top_logprobs"),
        ({"logit_bias": {"x1": 1.0}}, "logit_bias"), ({"bogus": 1}, "bogus"), ({"stream_options": {"include_usage": True}}, "stream_options"),
    ])
    def test_unsupported_values_name_the_field(self, body, param):
        assert api_error_of(ChatCompletionRequest, messages=CHAT, **body).param == param

    def test_logit_bias_becomes_integer_token_ids(self):
        params = ChatCompletionRequest(messages=CHAT, logit_bias={"5": 2, "17": -100}).to_sampling_params(0)
        assert params.logit_bias == {5: 2.0, 17: -100.0}
        assert ChatCompletionRequest(messages=CHAT).to_sampling_params(0).logit_bias is None

    def test_sampling_errors_name_the_field(self):
        with pytest.raises(APIError) as e:
            ChatCompletionRequest(messages=CHAT, top_k=0).to_sampling_params(0)
        assert e.value.param == "top_k" and e.value.status_code == 400


class TestRequestValues:
    @pytest.mark.parametrize("model, body, param", [
        (CompletionRequest, {"prompt": "a\ud800b"}, "prompt"),
        (CompletionRequest, {"prompt": ["ok", "a\udc00"]}, "prompt.1"),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages.0.content"),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
         "messages.0.content.0.text"),
        (ChatCompletionRequest, {"messages": CHAT, "stop": ["\udfff"]}, "stop.0"),
    ], ids=["prompt", "prompt_list", "message", "message_part", "stop"])
    def test_lone_surrogate_is_a_400_naming_the_field(self, model, body, param):
        err = api_error_of(model, **body)
        assert (err.status_code, err.param) == (400, param)
        assert "lone surrogate" in err.message
        err.message.encode("utf-8")  # the error body itself must be encodable

    @pytest.mark.parametrize("stop, param", [("", "stop"), ([""], "stop.0"), (["a", ""], "stop.1")])
    def test_empty_stop_string_is_rejected_in_either_form(self, stop, param):
        err = api_error_of(CompletionRequest, prompt="x", stop=stop)
        assert err.param == param and "non-empty" in err.message

    def test_out_of_range_value_names_the_bound(self):
        err = api_error_of(CompletionRequest, prompt="x", presence_penalty=2.5)
        assert (err.param, err.message) == ("presence_penalty", "invalid 'presence_penalty': expected a value <= 2, got 2.5")
        assert api_error_of(CompletionRequest, prompt="x", temperature=float("nan")).param == "temperature"

    def test_seed_at_its_limit_is_valid_for_every_choice(self):
        req = CompletionRequest(prompt="x", seed=2**63 - 1, n=2)  # seed + choice wraps, staying a valid seed
        assert [req.to_sampling_params(j).seed for j in range(2)] == [2**63 - 1, 0]

    def test_no_stop_strings_is_fine(self):
        assert CompletionRequest(prompt="x", stop=[]).to_sampling_params(0).stop == []

    def test_min_tokens_over_max_tokens_is_rejected(self):
        err = api_error_of(CompletionRequest, prompt="x", min_tokens=5, max_tokens=3)
        assert (err.param, err.message) == ("min_tokens", "min_tokens (5) must be <= max_tokens (3)")
        assert api_error_of(CompletionRequest, prompt="x", min_tokens=17).param == "min_tokens"  # default max_tokens 16
        assert CompletionRequest(prompt="x", min_tokens=3, max_tokens=3).to_sampling_params(0).min_tokens == 3

    def test_chat_min_tokens_is_checked_against_the_limit_that_applies(self):
        err = api_error_of(ChatCompletionRequest, messages=CHAT, min_tokens=5, max_tokens=10, max_completion_tokens=3)
        assert err.param == "min_tokens" and "max_completion_tokens (3)" in err.message
        assert ChatCompletionRequest(messages=CHAT, min_tokens=5, max_tokens=3, max_completion_tokens=8)
        assert ChatCompletionRequest(messages=CHAT, min_tokens=50)  # no limit given: max_model_len caps it


class FakeTokenizer:
    """Token id i decodes to PIECES[i]; two ids decode to the same replacement character."""

    PIECES = ["He", "llo", "\ufffd", "\ufffd", " w"]

    def decode(self, ids, **_):
        return "".join(self.PIECES[i] for i in ids)


class TestLogprobFormatter:
    def test_completion_shape_with_echo_and_offsets(self):
        fmt = LogprobFormatter(FakeTokenizer())
        out, end = fmt.completion([0, 1, 4], [None, (-1.0, {1: -1.0, 4: -2.0}), (-0.5, {})], 0)
        assert out == {"tokens": ["He", "llo", " w"], "token_logprobs": [None, -1.0, -0.5],
                       "top_logprobs": [None, {"llo": -1.0, " w": -2.0}, {" w": -0.5}], "text_offset": [0, 2, 5]}
        assert end == 7
        more, _ = fmt.completion([1], [(-3.0, {})], end)
        assert more["text_offset"] == [7]

    def test_tokens_that_decode_alike_keep_the_likelier(self):
        out, _ = LogprobFormatter(FakeTokenizer()).completion([2], [(-1.0, {2: -1.0, 3: -2.0})], 0)
        assert out["top_logprobs"] == [{"\ufffd": -1.0}]

    def test_chat_shape(self):
        [entry] = LogprobFormatter(FakeTokenizer()).chat([4], [(-0.5, {4: -0.5, 0: -1.5, 1: -2.5})], 2)
        assert entry == {"token": " w", "logprob": -0.5, "bytes": [32, 119], "top_logprobs": [
            {"token": " w", "logprob": -0.5, "bytes": [32, 119]}, {"token": "He", "logprob": -1.5, "bytes": [72, 101]}]}
