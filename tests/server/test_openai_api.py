"""The OpenAI API of `atomctl serve`, through the OpenAI SDK and httpx, on one shared server.

The last test (SIGTERM drain) stops the module's server, so it stays last in the file.
"""
from __future__ import annotations

import asyncio
import json
import math
import signal
import threading
import time

import httpx
import openai
import pytest

from atom_core import SamplingParams
from tests.server.conftest import MAX_MODEL_LEN

PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "Hello world! This is a tiny test."}]


def chat_prompt_ids(engine, messages) -> list[int]:
    text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return engine.tokenizer.encode(text, add_special_tokens=False)


def sse_events(lines) -> list:
    """`data:` payloads of an SSE body: dicts, and the final "[DONE]"."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def wait_until(predicate, timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def engine_idle(server) -> bool:
    m = server.metrics()
    return (m["atom_num_requests_running"] == 0 and m["atom_num_requests_waiting"] == 0
            and m["atom_kv_cache_blocks_free"] == m["atom_kv_cache_blocks_total"])


# ---- basics ---------------------------------------------------------------------------
class TestModels:
    def test_lists_the_served_model(self, server):
        models = server.openai().models.list()
        assert [m.id for m in models.data] == [server.model_name]

    def test_unknown_model_is_404(self, server):
        with pytest.raises(openai.NotFoundError) as e:
            server.openai().completions.create(model="nope", prompt=PROMPT, max_tokens=2)
        assert e.value.body["code"] == "model_not_found"


class TestChat:
    def test_served_text_equals_llm_engine(self, server, reference_engine):
        resp = server.openai().chat.completions.create(model=server.model_name, messages=CHAT, max_tokens=12, temperature=0)
        ids = chat_prompt_ids(reference_engine, CHAT)
        [ref] = reference_engine.generate([ids], SamplingParams(temperature=0, max_tokens=12))
        choice = resp.choices[0]
        assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion"
        assert choice.message.role == "assistant" and choice.message.content == ref["text"]
        assert choice.finish_reason == ref["finish_reason"]
        usage = resp.usage.model_dump()
        assert usage["prompt_tokens"] == len(ids)
        assert usage["completion_tokens"] == ref["num_tokens_output"]
        assert usage["total_tokens"] == len(ids) + ref["num_tokens_output"]
        assert 0 < usage["ttft_s"] <= usage["latency_s"] and usage["tpot_s"] >= 0

    def test_stream_matches_non_stream(self, server):
        client = server.openai()
        full = client.chat.completions.create(model=server.model_name, messages=CHAT, max_tokens=10, temperature=0)
        chunks = list(client.chat.completions.create(model=server.model_name, messages=CHAT, max_tokens=10, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert text == full.choices[0].message.content
        assert finishes == [full.choices[0].finish_reason]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
        assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens

    def test_logprobs(self, server):
        resp = server.openai().chat.completions.create(model=server.model_name, messages=CHAT, max_tokens=6, temperature=0,
                                                       logprobs=True, top_logprobs=3)
        content = resp.choices[0].logprobs.content
        assert len(content) == resp.usage.completion_tokens
        for entry in content:
            assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
            tops = [t.logprob for t in entry.top_logprobs]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True)
            assert math.isclose(entry.logprob, tops[0], abs_tol=1e-5)  # greedy: the chosen token is the top one

    def test_n2_with_seed_is_reproducible(self, server):
        kw = dict(model=server.model_name, messages=CHAT, max_tokens=8, temperature=1.0, n=2, seed=1234,
                  extra_body={"ignore_eos": True})
        client = server.openai()
        first = client.chat.completions.create(**kw)
        again = client.chat.completions.create(**kw)
        assert [c.index for c in first.choices] == [0, 1]
        assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
        assert first.choices[0].message.content != first.choices[1].message.content  # seeds are offset per choice
        assert first.usage.completion_tokens == 16
        single = client.chat.completions.create(model=server.model_name, messages=CHAT, max_tokens=1)
        assert first.usage.prompt_tokens == single.usage.prompt_tokens  # counted once, not per choice
        other_seed = client.chat.completions.create(**(kw | {"seed": 99}))
        assert [c.message.content for c in other_seed.choices] != [c.message.content for c in first.choices]

    def test_n2_stream(self, server):
        chunks = list(server.openai().chat.completions.create(
            model=server.model_name, messages=CHAT, max_tokens=5, temperature=1.0, n=2, stream=True))
        roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
        finished = sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason)
        assert sorted(roles) == [0, 1] and finished == [0, 1]

    def test_chat_template_kwargs_and_max_completion_tokens(self, server):
        resp = server.openai().chat.completions.create(
            model=server.model_name, messages=CHAT, max_completion_tokens=3, temperature=0,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True})
        assert resp.usage.completion_tokens == 3 and resp.choices[0].finish_reason == "length"


class TestCompletions:
    @pytest.mark.parametrize("prompt", [PROMPT, "naïve café 東京 🚀"])
    def test_served_text_equals_llm_engine(self, server, reference_engine, prompt):
        resp = server.openai().completions.create(model=server.model_name, prompt=prompt, max_tokens=16, temperature=0)
        [ref] = reference_engine.generate([prompt], SamplingParams(temperature=0, max_tokens=16))
        assert resp.id.startswith("cmpl-") and resp.object == "text_completion"
        assert resp.choices[0].text == ref["text"]
        assert resp.usage.prompt_tokens == ref["num_tokens_input"]
        assert resp.usage.completion_tokens == ref["num_tokens_output"]

    def test_stream_matches_non_stream(self, server):
        client = server.openai()
        kw = dict(model=server.model_name, prompt=PROMPT, max_tokens=12, temperature=0)
        full = client.completions.create(**kw)
        chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
        assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens

    def test_prompt_forms(self, server, reference_engine):
        client = server.openai()
        ids = reference_engine.tokenizer.encode(PROMPT)
        by_text = client.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=6, temperature=0)
        by_ids = client.completions.create(model=server.model_name, prompt=ids, max_tokens=6, temperature=0)
        batch = client.completions.create(model=server.model_name, prompt=[ids, ids[:2]], max_tokens=6, temperature=0, n=2)
        strings = client.completions.create(model=server.model_name, prompt=[PROMPT, "Hello"], max_tokens=6, temperature=0)
        assert by_ids.choices[0].text == by_text.choices[0].text
        assert [c.index for c in batch.choices] == [0, 1, 2, 3]
        assert batch.choices[0].text == by_text.choices[0].text == batch.choices[1].text
        assert batch.usage.prompt_tokens == len(ids) + 2
        assert strings.choices[0].text == by_text.choices[0].text and len(strings.choices) == 2

    def test_logit_bias_equals_llm_engine_with_the_same_bias(self, server, reference_engine):
        """The SDK's logit_bias ({token id string: bias}) reaches the sampler: a banned first pick and a
        forced token, as LLMEngine with SamplingParams(logit_bias=...) gives them, chat and completions."""
        client = server.openai()
        [plain] = reference_engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        first = plain["token_ids"][0]
        bias = {first: -100.0, 7: 3.0}
        [ref] = reference_engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                                   logit_bias=bias))
        resp = client.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=6, temperature=0,
                                         logit_bias={str(k): v for k, v in bias.items()},
                                         extra_body={"ignore_eos": True})
        assert resp.choices[0].text == ref["text"] and ref["token_ids"][0] != first
        forced = client.chat.completions.create(model=server.model_name, messages=CHAT, max_tokens=4, temperature=0,
                                                logit_bias={"42": 100}, extra_body={"ignore_eos": True})
        assert forced.choices[0].message.content == reference_engine.tokenizer.decode([42] * 4)

    def test_allowed_token_ids_bound_every_token(self, server, reference_engine):
        """vLLM's allowed_token_ids: only those ids come out, sampled or greedy, as LLMEngine gives them."""
        allowed = [11, 42, 97]
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed)
        [ref] = reference_engine.generate([PROMPT], params)
        resp = self._completion(server, {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                         "allowed_token_ids": allowed, "return_token_ids": True})
        assert resp["choices"][0]["token_ids"] == ref["token_ids"] and set(ref["token_ids"]) <= set(allowed)
        sampled = self._completion(server, {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 3,
                                            "ignore_eos": True, "allowed_token_ids": allowed, "return_token_ids": True})
        assert set(sampled["choices"][0]["token_ids"]) <= set(allowed)

    @staticmethod
    def _completion(server, body: dict) -> dict:
        r = httpx.post(f"{server.url}/v1/completions", json={"model": server.model_name, **body}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    def test_stop_string_cuts_text(self, server):
        client = server.openai()
        kw = dict(model=server.model_name, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
        full = client.completions.create(**kw).choices[0].text
        k = next(i for i in range(3, len(full) - 2)
                 if full.find(full[i:i + 2]) == i and "\ufffd" not in full[i:i + 2] and full[i:i + 2].strip())
        stop = full[k:k + 2]
        resp = client.completions.create(**kw, stop=[stop])
        assert resp.choices[0].text == full[:k] and resp.choices[0].finish_reason == "stop"
        assert resp.choices[0].stop_reason == stop  # vLLM's field: the stop string that matched
        streamed = list(client.completions.create(**kw, stop=stop, stream=True))
        assert "".join(c.choices[0].text for c in streamed) == full[:k]
        assert streamed[-1].choices[0].finish_reason == "stop" and streamed[-1].choices[0].stop_reason == stop
        assert wait_until(lambda: engine_idle(server), what="the stopped request to leave the core")

    def test_stop_reason_names_the_stop_token_and_is_none_otherwise(self, server, reference_engine):
        """vLLM's stop_reason: a listed stop token's id; None for a length (or an unlisted end of sequence)."""
        [ref] = reference_engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        ids = ref["token_ids"]
        k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
        client = server.openai()
        kw = dict(model=server.model_name, prompt=PROMPT, max_tokens=8, temperature=0)
        stopped = client.completions.create(**kw, extra_body={"ignore_eos": True, "stop_token_ids": [ids[k]]})
        assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].stop_reason == ids[k]
        chat = client.chat.completions.create(model=server.model_name, messages=CHAT, max_tokens=3, temperature=0,
                                              extra_body={"ignore_eos": True})
        assert chat.choices[0].finish_reason == "length" and chat.choices[0].stop_reason is None
        long = client.completions.create(**kw, extra_body={"ignore_eos": True})
        assert long.choices[0].finish_reason == "length" and long.choices[0].stop_reason is None

    def test_truncate_prompt_tokens_keeps_the_last_tokens(self, server, reference_engine):
        """vLLM's truncate_prompt_tokens: the prompt's last k tokens are the prompt (usage counts them);
        a shorter prompt is kept whole; 0 is a 400 naming the field."""
        ids = reference_engine.tokenizer.encode(PROMPT * 3)
        client = server.openai()
        kw = dict(model=server.model_name, max_tokens=6, temperature=0)
        [ref] = reference_engine.generate([ids[-5:]], SamplingParams(temperature=0, max_tokens=6))
        cut = client.completions.create(prompt=ids, extra_body={"truncate_prompt_tokens": 5}, **kw)
        assert cut.usage.prompt_tokens == 5 and cut.choices[0].text == ref["text"]
        whole = client.completions.create(prompt=ids[:4], extra_body={"truncate_prompt_tokens": 5}, **kw)
        assert whole.usage.prompt_tokens == 4
        chat = client.chat.completions.create(messages=CHAT, extra_body={"truncate_prompt_tokens": 3}, **kw)
        assert chat.usage.prompt_tokens == 3
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(prompt=ids, extra_body={"truncate_prompt_tokens": 0}, **kw)
        assert e.value.body["param"] == "truncate_prompt_tokens"

    def test_logprobs_shape(self, server):
        resp = server.openai().completions.create(model=server.model_name, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
        lp = resp.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
        assert lp.text_offset[0] == 0
        for token, chosen, tops in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert chosen <= 0 and token in tops and max(tops.values()) == pytest.approx(chosen, abs=1e-5)

    def test_echo_logprobs_equal_llm_engine_prompt_logprobs(self, server, reference_engine):
        # lm-eval's loglikelihood request: echo the prompt, score it, generate one token.
        resp = server.openai().completions.create(model=server.model_name, prompt=PROMPT, max_tokens=1, temperature=0,
                                                  logprobs=1, echo=True)
        ids = reference_engine.tokenizer.encode(PROMPT)
        [ref] = reference_engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1, logprobs=1))
        choice = resp.choices[0]
        lp = choice.logprobs
        assert choice.text == PROMPT + ref["text"]
        assert len(lp.tokens) == len(ids) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        expected = [entry[0] for entry in ref["prompt_logprobs"][1:]] + [ref["logprobs"][0][0]]
        assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
        assert "".join(lp.tokens[: len(ids)]) == PROMPT
        assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 1

    def test_echo_stream_sends_prompt_first(self, server):
        chunks = list(server.openai().completions.create(model=server.model_name, prompt=PROMPT, max_tokens=3, temperature=0,
                                                         echo=True, stream=True))
        assert chunks[0].choices[0].text.startswith(PROMPT)


# ---- operations -----------------------------------------------------------------------
class TestOperations:
    def test_metrics_names(self, server):
        m = server.metrics()
        for name in ("atom_num_requests_running", "atom_num_requests_waiting", "atom_kv_cache_blocks_free",
                     "atom_kv_cache_blocks_used", "atom_prefix_cache_hit_rate", "atom_prompt_tokens_total",
                     "atom_generation_tokens_total", "atom_time_to_first_token_seconds_count",
                     "atom_time_per_output_token_seconds_count", "atom_e2e_request_latency_seconds_count"):
            assert name in m, name
        assert m["atom_generation_tokens_total"] > 0

    def test_profile_without_dir_is_400(self, server):
        r = httpx.post(f"{server.url}/start_profile", timeout=10)
        assert r.status_code == 400 and "profiler dir" in r.json()["error"]["message"]
        r = httpx.post(f"{server.url}/stop_profile", timeout=10)
        assert r.status_code == 400

    def test_health(self, server):
        assert httpx.get(f"{server.url}/health", timeout=10).json() == {"status": "ok"}


class TestConcurrency:
    NUM_STREAMS = 200
    MAX_TOKENS = 6

    def test_200_concurrent_streams_complete(self, server):
        async def one(client: httpx.AsyncClient, i: int):
            body = {"model": server.model_name, "prompt": f"Hello world {i}", "max_tokens": self.MAX_TOKENS,
                    "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            async with client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
                assert r.status_code == 200
                return i, sse_events([line async for line in r.aiter_lines()])

        async def run_all():
            limits = httpx.Limits(max_connections=self.NUM_STREAMS + 10)
            async with httpx.AsyncClient(timeout=120, limits=limits) as client:
                return await asyncio.gather(*(one(client, i) for i in range(self.NUM_STREAMS)))

        results = asyncio.run(run_all())
        assert len(results) == self.NUM_STREAMS
        for i, events in results:
            assert events[-1] == "[DONE]"
            chunks, usage = events[:-2], events[-2]["usage"]
            assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
            assert sum(1 for c in chunks if c["choices"][0]["finish_reason"]) == 1
            assert usage["completion_tokens"] == self.MAX_TOKENS
            assert usage["prompt_tokens"] == usage["total_tokens"] - self.MAX_TOKENS
        assert engine_idle(server)
        assert server.metrics()["atom_num_api_requests_in_flight"] == 0


class TestDisconnect:
    def test_dropped_stream_is_aborted_and_frees_blocks(self, server):
        aborted_before = server.metrics().get('atom_request_success_total{finished_reason="abort"}', 0)
        body = {"model": server.model_name, "prompt": PROMPT, "max_tokens": MAX_MODEL_LEN - 16, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            # The first text delta: the request is running (its 496 tokens take far longer).
            assert next(line for line in lines if line.startswith("data: "))
            assert server.metrics()["atom_num_requests_running"] == 1
        # Leaving the block closed the connection mid-stream.
        wait_until(lambda: engine_idle(server), timeout=10, what="the aborted request's blocks to be freed")
        assert server.metrics()['atom_request_success_total{finished_reason="abort"}'] == aborted_before + 1

    def test_dropped_non_stream_request_is_aborted(self, server):
        body = {"model": server.model_name, "prompt": PROMPT, "max_tokens": MAX_MODEL_LEN - 16, "temperature": 0,
                "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            # read timeout well below the ~0.5 s+ the 496-token generation takes on the CPU
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.2))
        wait_until(lambda: engine_idle(server), timeout=10, what="the abandoned request to be aborted")


# ---- bad input ------------------------------------------------------------------------
LONG = "The quick brown fox jumps over the lazy dog. " * 60  # well over MAX_MODEL_LEN tokens
BAD_INPUTS = [
    # (id, path, body (dict, or raw str), status, error param, message fragment)
    ("invalid_json", "/v1/completions", '{"prompt": "x",', 400, None, "invalid JSON"),
    ("body_not_object", "/v1/completions", "[1, 2]", 400, None, ""),
    ("missing_prompt", "/v1/completions", {"max_tokens": 2}, 400, "prompt", "required"),
    ("max_tokens_wrong_type", "/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens", "integer"),
    ("temperature_wrong_type", "/v1/chat/completions", {"messages": CHAT, "temperature": "hot"}, 400, "temperature", ""),
    ("messages_not_list", "/v1/chat/completions", {"messages": "hi"}, 400, "messages", ""),
    ("empty_messages", "/v1/chat/completions", {"messages": []}, 400, "messages", "at least 1"),
    ("bad_role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role", ""),
    ("image_content", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, None, ""),
    ("empty_prompt", "/v1/completions", {"prompt": ""}, 400, "prompt", "empty"),
    ("empty_prompt_list", "/v1/completions", {"prompt": []}, 400, "prompt", "empty"),
    ("prompt_mixed_types", "/v1/completions", {"prompt": ["a", 1]}, 400, "prompt", ""),
    ("token_id_out_of_range", "/v1/completions", {"prompt": [1, 10**6]}, 400, "prompt", "out of range"),
    ("prompt_too_long", "/v1/completions", {"prompt": LONG, "max_tokens": 1}, 400, "prompt", "max_model_len"),
    ("prompt_plus_max_tokens_too_long", "/v1/completions", {"prompt": PROMPT, "max_tokens": MAX_MODEL_LEN}, 400,
     "max_tokens", "exceeds max_model_len"),
    ("chat_too_long", "/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages", "max_model_len"),
    ("negative_max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens", ">= 1"),
    ("negative_max_completion_tokens", "/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": -5}, 400,
     "max_completion_tokens", ">= 1"),
    ("n_zero", "/v1/completions", {"prompt": "x", "n": 0}, 400, "n", "expected a value >= 1, got 0"),
    ("n_too_big", "/v1/chat/completions", {"messages": CHAT, "n": 1000}, 400, "n", "expected a value <= 128, got 1000"),
    ("top_p_zero", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", "top_p"),
    ("negative_temperature", "/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", ""),
    ("logprobs_too_many", "/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs", ""),
    ("top_logprobs_without_logprobs", "/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs", ""),
    ("stop_wrong_type", "/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop", ""),
    ("stop_empty_string", "/v1/completions", {"prompt": "x", "stop": ""}, 400, "stop", "non-empty"),
    ("stop_empty_in_list", "/v1/chat/completions", {"messages": CHAT, "stop": ["a", ""]}, 400, "stop.1", "non-empty"),
    ("temperature_infinite", "/v1/completions", '{"prompt": "x", "temperature": Infinity}', 400, "temperature", "finite"),
    ("min_tokens_over_max_tokens", "/v1/completions", {"prompt": "x", "min_tokens": 5, "max_tokens": 3}, 400,
     "min_tokens", "must be <= max_tokens (3)"),
    ("min_tokens_over_max_completion_tokens", "/v1/chat/completions",
     {"messages": CHAT, "min_tokens": 5, "max_completion_tokens": 3}, 400, "min_tokens", "max_completion_tokens (3)"),
    # JSON allows lone surrogates; they are not text (raw bodies: httpx would not encode them)
    ("prompt_lone_surrogate", "/v1/completions", '{"prompt": "a\\ud800b"}', 400, "prompt", "lone surrogate"),
    ("message_lone_surrogate", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
     400, "messages.0.content", "lone surrogate"),
    ("model_lone_surrogate", "/v1/completions", '{"model": "\\udc00", "prompt": "x"}', 400, "model", "lone surrogate"),
    ("unknown_field", "/v1/completions", {"prompt": "x", "frobnicate": True}, 400, "frobnicate", "unsupported"),
    ("tools_auto_without_server_flags", "/v1/chat/completions",
     {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice",
     "--enable-auto-tool-choice"),
    ("logit_bias_key_not_a_token_id", "/v1/completions", {"prompt": "x", "logit_bias": {"five": 10}}, 400,
     "logit_bias", "token ids as decimal strings, got 'five'"),
    ("logit_bias_out_of_range", "/v1/chat/completions", {"messages": CHAT, "logit_bias": {"5": -101}}, 400,
     "logit_bias", "logit_bias[5] = -101.0 is outside [-100, 100]"),
    ("logit_bias_past_the_vocabulary", "/v1/completions", {"prompt": "x", "logit_bias": {"1000000": 1}}, 400,
     "logit_bias", "out of range"),
    ("allowed_token_ids_past_the_vocabulary", "/v1/completions", {"prompt": "x", "allowed_token_ids": [3, 10**6]},
     400, "allowed_token_ids", "out of range"),
    ("allowed_token_ids_empty", "/v1/chat/completions", {"messages": CHAT, "allowed_token_ids": []}, 400,
     "allowed_token_ids", ""),
    ("best_of_unsupported", "/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of", ""),
    ("response_format_unknown_type", "/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "yaml"}},
     400, "response_format.type", ""),
    ("stream_options_without_stream", "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}},
     400, "stream_options", ""),
    ("unknown_model", "/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model", "does not exist"),
    ("unknown_path", "/v1/embeddings", {"input": "x"}, 404, None, ""),
]


class TestBadInput:
    @pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
    def test_rejected_with_openai_error_then_good_request_works(self, server, case):
        _, path, body, status, param, fragment = case
        kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) else {"json": body}
        r = httpx.post(f"{server.url}{path}", timeout=30, **kw)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["message"] and error["type"]
        if param is not None:
            assert error["param"] == param, error
        assert fragment in error["message"], error
        ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


# ---- the OpenAPI document's value ranges --------------------------------------------------
ON, PAST, FAR = "on the bound", "past the bound", "far from the bounds"


def bound_probes(schema: dict, sample=None) -> list[tuple]:
    """(value, where) for every bound of a field's schema, its union branches and its array items:
    a value ON a bound and one just PAST it, and a value FAR out on a side without a bound.
    `sample`: a valid array item where the items' schema gives none (a $ref)."""
    probes = []
    for branch in schema.get("anyOf", [schema]):
        kind = branch.get("type")
        if kind in ("integer", "number"):
            step = 1 if kind == "integer" else 1e-6
            num = int if kind == "integer" else float
            for key, on, past in (("minimum", 0, -step), ("maximum", 0, step),
                                  ("exclusiveMinimum", step, 0), ("exclusiveMaximum", -step, 0)):
                if key in branch:
                    probes += [(num(branch[key]) + on, ON), (num(branch[key]) + past, PAST)]
            if "const" in branch.get("not", {}):
                probes.append((branch["not"]["const"], PAST))
            far = num(2**31 - 1 if kind == "integer" else 1e6)
            if "maximum" not in branch and "exclusiveMaximum" not in branch:
                probes.append((far, FAR))
            if "minimum" not in branch and "exclusiveMinimum" not in branch:
                probes.append((-far, FAR))
        elif kind == "string" and "minLength" in branch:
            probes += [("x" * branch["minLength"], ON), ("x" * (branch["minLength"] - 1), PAST)]
        elif kind == "array":
            if "minItems" in branch:
                item = valid_sample(branch["items"], sample)
                probes += [([item] * branch["minItems"], ON), ([item] * (branch["minItems"] - 1), PAST)]
            probes += [([value], where) for value, where in bound_probes(branch["items"])]
    return probes


def valid_sample(schema: dict, fallback=None):
    kind = schema.get("type")
    if kind in ("integer", "number"):
        return schema.get("minimum", 0)
    if kind == "string":
        return "x"
    if kind == "array":
        return [valid_sample(schema["items"])]
    assert fallback is not None, f"no valid sample for {schema}"
    return fallback


RANGE_BASES = {  # a valid request of each endpoint; one generated token keeps 200s cheap
    "/v1/completions": ("CompletionRequest", {"prompt": PROMPT, "max_tokens": 1}),
    "/v1/chat/completions": ("ChatCompletionRequest", {"messages": CHAT, "max_tokens": 1}),
}
BOUNDED = {  # fields whose bounds the document must state (so the walk cannot pass by finding none)
    "/v1/completions": {"prompt", "max_tokens", "logprobs"},
    "/v1/chat/completions": {"messages", "max_tokens", "max_completion_tokens", "top_logprobs"},
}
SHARED_BOUNDED = {"temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "min_tokens", "n",
                  "presence_penalty", "frequency_penalty", "repetition_penalty", "best_of", "guided_choice",
                  "allowed_token_ids", "truncate_prompt_tokens"}
# Limits that depend on the model or on another field: a far value is a 400, which the field's
# description must state (context length, vocabulary size, min_tokens <= max_tokens).
MODEL_LIMITED = {"max_tokens", "max_completion_tokens", "min_tokens", "prompt", "allowed_token_ids"}


def companion(field: str, value) -> dict:
    """Other fields a value needs to be valid (cross-field rules the schema only describes)."""
    if field == "top_logprobs":
        return {"logprobs": True}
    if field == "best_of" and isinstance(value, int) and 1 <= value <= 128:
        return {"n": value}  # best_of must be 1 or n
    return {}


class TestDocumentedRanges:
    @pytest.mark.parametrize("path", list(RANGE_BASES))
    def test_every_bound_is_accepted_and_the_value_past_it_is_a_400(self, server, path):
        """Walks the served OpenAPI document, so schema and server cannot drift apart."""
        doc = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
        name, base = RANGE_BASES[path]
        walked, failures = set(), []
        for field, schema in doc["components"]["schemas"][name]["properties"].items():
            sample = base[field][0] if isinstance(base.get(field), list) else None
            for value, where in bound_probes(schema, sample):
                walked.add(field)
                want = 400 if where == PAST or (where == FAR and field in MODEL_LIMITED) else 200
                r = httpx.post(f"{server.url}{path}", json=base | companion(field, value) | {field: value}, timeout=60)
                param = r.json()["error"]["param"] if r.status_code == 400 else None
                if where == PAST and param is not None and param != field and not param.startswith(f"{field}."):
                    failures.append(f"{field}={value!r} ({where}): the 400 names {param!r}")
                if r.status_code != want:
                    failures.append(f"{field}={value!r} ({where}): {r.status_code}, want {want}: {r.text[:200]}")
        assert BOUNDED[path] | SHARED_BOUNDED <= walked, sorted(BOUNDED[path] | SHARED_BOUNDED - walked)
        for field in MODEL_LIMITED & walked:
            assert doc["components"]["schemas"][name]["properties"][field].get("description"), field
        assert not failures, "\n".join(failures)


# ---- shutdown (stops the module's server: keep last) ------------------------------------
class TestReturnTokenIds:
    """vLLM's return_token_ids: output ids per choice (streamed: each chunk's new ones) and the prompt's
    ids (completions: per choice, with its first chunk; chat: on the response, or its first chunk)."""

    def _post(self, server, path: str, body: dict):
        return httpx.post(f"{server.url}{path}", json={"model": server.model_name, **body}, timeout=60)

    def _stream(self, server, path: str, body: dict) -> list[dict]:
        with httpx.stream("POST", f"{server.url}{path}", json={"model": server.model_name, "stream": True, **body},
                          timeout=60) as r:
            return [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]

    def test_completions(self, server, reference_engine):
        ids = reference_engine.tokenizer.encode(PROMPT)
        body = {"prompt": ids, "max_tokens": 8, "temperature": 0, "n": 2, "ignore_eos": True, "return_token_ids": True}
        [ref] = reference_engine.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        choices = self._post(server, "/v1/completions", body).json()["choices"]
        assert [c["token_ids"] for c in choices] == [ref["token_ids"]] * 2
        assert all(c["prompt_token_ids"] == ids for c in choices)
        events = self._stream(server, "/v1/completions", body)
        for index in (0, 1):
            mine = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == index]
            assert [t for c in mine for t in c["token_ids"]] == ref["token_ids"]
            assert mine[0]["prompt_token_ids"] == ids and all("prompt_token_ids" not in c for c in mine[1:])

    def test_chat(self, server, reference_engine):
        body = {"messages": CHAT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        prompt = chat_prompt_ids(reference_engine, CHAT)
        [ref] = reference_engine.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        resp = self._post(server, "/v1/chat/completions", body).json()
        assert resp["prompt_token_ids"] == prompt and resp["choices"][0]["token_ids"] == ref["token_ids"]
        events = self._stream(server, "/v1/chat/completions", body)
        assert events[0]["prompt_token_ids"] == prompt and all("prompt_token_ids" not in e for e in events[1:])
        assert [t for e in events for c in e["choices"] for t in c.get("token_ids", [])] == ref["token_ids"]

    def test_off_by_default(self, server):
        resp = self._post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}).json()
        assert "prompt_token_ids" not in resp and "token_ids" not in resp["choices"][0]
        choice = self._post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).json()["choices"][0]
        assert "token_ids" not in choice and "prompt_token_ids" not in choice


class TestCacheSalt:
    def test_server_reports_cached_tokens_per_salt(self, server):
        """vLLM's cache_salt: only a repeat with the same salt finds the prompt cached; an empty salt is a 400."""
        long_prompt = " ".join(["token"] * 60)

        def cached(salt: str) -> int:
            body = {"model": server.model_name, "prompt": long_prompt, "max_tokens": 2, "cache_salt": salt}
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        counts = [cached(s) for s in ("s1", "s2", "s1")]
        assert counts[0] == counts[1] == 0 and counts[2] > 0
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                       json={"model": server.model_name, "messages": CHAT, "cache_salt": ""})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


class TestShutdown:
    def test_sigterm_drains_in_flight_streams(self, server):
        num_tokens = 40
        results: dict[int, list] = {}
        first_token = threading.Barrier(4)

        def stream(i: int):
            body = {"model": server.model_name, "prompt": f"{PROMPT} {i}", "max_tokens": num_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            lines = []
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    if len(lines) == 2:
                        first_token.wait(30)
            results[i] = sse_events(lines)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        first_token.wait(30)
        server.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert server.proc.wait(60) == 0, server.log()
        for events in results.values():
            assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == num_tokens
        assert len(results) == 3
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{server.url}/health", timeout=2)
