"""The Anthropic Messages API of `atomctl serve` through the `anthropic` SDK and httpx, on the
session's demo tools server (hermes, auto tool choice, qwen3 reasoning parser)."""
from __future__ import annotations

import anthropic
import httpx
import pytest

from tests.server.test_openai_api import engine_idle, wait_until
from tests.server.test_tools import TOOLS

ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
USER = "123 + 456"
LONG_TOOL = [{"name": "say", "input_schema": {"type": "object", "properties": {"s": {"type": "string", "minLength": 400}},
                                              "required": ["s"]}}]


@pytest.fixture(scope="module")
def srv(demo_tools_server):
    return demo_tools_server


def client(srv) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0)


def chat(srv, messages, **kw):
    return srv.openai().chat.completions.create(model=srv.model_name, messages=messages, temperature=0, **kw)


class TestText:
    def test_greedy_output_equals_chat_completions(self, srv):
        msg = client(srv).messages.create(model=srv.model_name, max_tokens=10, system="Be brief.",
                                          messages=[{"role": "user", "content": USER}], extra_body={"temperature": 0})
        ref = chat(srv, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": USER}], max_tokens=10)
        assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
        assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == ref.choices[0].message.content
        assert msg.stop_reason == ("max_tokens" if ref.choices[0].finish_reason == "length" else "end_turn")
        assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == ref.usage.prompt_tokens
        assert msg.usage.output_tokens == ref.usage.completion_tokens
        count = client(srv).messages.count_tokens(model=srv.model_name, system="Be brief.",
                                                  messages=[{"role": "user", "content": USER}])
        assert count.input_tokens == ref.usage.prompt_tokens

    def test_stream_events_add_up_to_the_message(self, srv):
        kw = dict(model=srv.model_name, max_tokens=8, messages=[{"role": "user", "content": [{"type": "text", "text": USER}]}],
                  extra_body={"temperature": 0})
        full = client(srv).messages.create(**kw)
        events = list(client(srv).messages.create(**kw, stream=True))
        types = [e.type for e in events]
        assert types[:2] == ["message_start", "content_block_start"] and types[-3:] == [
            "content_block_stop", "message_delta", "message_stop"]
        text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
        assert text == full.content[0].text
        assert events[-2].delta.stop_reason == full.stop_reason and events[-2].usage.output_tokens == full.usage.output_tokens

    def test_stop_sequences(self, srv):
        kw = dict(model=srv.model_name, max_tokens=24, messages=[{"role": "user", "content": USER}],
                  extra_body={"temperature": 0})
        text = client(srv).messages.create(**kw).content[0].text
        k = next(i for i in range(1, len(text)) if text.find(text[i]) == i and text[i].strip())  # a first occurrence
        stop = text[k]
        msg = client(srv).messages.create(**kw, stop_sequences=[stop])
        assert msg.content[0].text == text[:k] and msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop


class TestTools:
    def test_tool_use_round_trip_equals_chat(self, srv):
        c = client(srv)
        first = c.messages.create(model=srv.model_name, max_tokens=40, tools=ANTHROPIC_TOOLS,
                                  tool_choice={"type": "tool", "name": "add"},
                                  messages=[{"role": "user", "content": USER}], extra_body={"temperature": 0})
        [use] = first.content
        assert use.type == "tool_use" and use.name == "add" and set(use.input) == {"a", "b"}
        assert first.stop_reason == "tool_use"
        second = c.messages.create(model=srv.model_name, max_tokens=8, tools=ANTHROPIC_TOOLS, tool_choice={"type": "none"},
                                   extra_body={"temperature": 0}, messages=[
                                       {"role": "user", "content": USER},
                                       {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                                     "content": "579"}]}])
        import json
        ref = chat(srv, [{"role": "user", "content": USER},
                         {"role": "assistant", "content": "", "tool_calls": [
                             {"id": use.id, "type": "function", "function": {"name": "add", "arguments": json.dumps(use.input)}}]},
                         {"role": "tool", "tool_call_id": use.id, "content": "579"}],
                   tools=TOOLS, tool_choice="none", max_tokens=8)
        assert second.content[0].text == ref.choices[0].message.content

    def test_streamed_tool_input_adds_up(self, srv):
        import json
        events = list(client(srv).messages.create(
            model=srv.model_name, max_tokens=40, tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "negate"},
            messages=[{"role": "user", "content": USER}], stream=True, extra_body={"temperature": 0}))
        start = next(e for e in events if e.type == "content_block_start")
        assert start.content_block.type == "tool_use" and start.content_block.name == "negate"
        partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
        assert set(json.loads(partial)) == {"x"} and events[-2].delta.stop_reason == "tool_use"


class TestDisconnect:
    def test_dropped_stream_is_aborted_and_frees_blocks(self, srv):
        before = srv.metrics().get('atom_request_success_total{finished_reason="abort"}', 0)
        body = {"model": srv.model_name, "max_tokens": 480, "stream": True, "tools": LONG_TOOL,
                "tool_choice": {"type": "tool", "name": "say"}, "messages": [{"role": "user", "content": USER}]}
        with httpx.stream("POST", f"{srv.url}/v1/messages", json=body, timeout=60) as r:
            assert next(line for line in r.iter_lines() if "input_json_delta" in line)
        wait_until(lambda: engine_idle(srv), what="the dropped stream's request to be aborted")
        assert srv.metrics()['atom_request_success_total{finished_reason="abort"}'] == before + 1


MSG = [{"role": "user", "content": "x"}]
BAD = [
    # (id, path, body, status, error type, fragment)
    ("missing_max_tokens", "/v1/messages", {"messages": MSG}, 400, "invalid_request_error", "max_tokens"),
    ("max_tokens_zero", "/v1/messages", {"messages": MSG, "max_tokens": 0}, 400, "invalid_request_error", ">= 1"),
    ("empty_messages", "/v1/messages", {"messages": [], "max_tokens": 1}, 400, "invalid_request_error", "at least 1"),
    ("bad_role", "/v1/messages", {"messages": [{"role": "system", "content": "x"}], "max_tokens": 1}, 400,
     "invalid_request_error", ""),
    ("image_block", "/v1/messages", {"max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}]}, 400, "invalid_request_error", ""),
    ("temperature_over_1", "/v1/messages", {"messages": MSG, "max_tokens": 1, "temperature": 1.5}, 400,
     "invalid_request_error", "<= 1"),
    ("empty_stop_sequence", "/v1/messages", {"messages": MSG, "max_tokens": 1, "stop_sequences": [""]}, 400,
     "invalid_request_error", "non-empty"),
    ("tool_choice_tool_without_name", "/v1/messages", {"messages": MSG, "max_tokens": 1, "tools": ANTHROPIC_TOOLS,
                                                        "tool_choice": {"type": "tool"}}, 400, "invalid_request_error", "name"),
    ("tool_choice_unknown_tool", "/v1/messages", {"messages": MSG, "max_tokens": 1, "tools": ANTHROPIC_TOOLS,
                                                   "tool_choice": {"type": "tool", "name": "mul"}}, 400,
     "invalid_request_error", "not in tools"),
    ("thinking_enabled", "/v1/messages", {"messages": MSG, "max_tokens": 1, "thinking": {"type": "enabled",
                                                                                          "budget_tokens": 10}}, 400,
     "invalid_request_error", ""),
    ("output_overflow", "/v1/messages", {"messages": MSG, "max_tokens": 512}, 400, "invalid_request_error",
     "max_model_len"),
    ("unknown_field", "/v1/messages", {"messages": MSG, "max_tokens": 1, "frobnicate": 1}, 400,
     "invalid_request_error", "unsupported"),
    ("invalid_json", "/v1/messages", '{"messages": ', 400, "invalid_request_error", "invalid JSON"),
    ("unknown_model", "/v1/messages", {"messages": MSG, "max_tokens": 1, "model": "claude-x"}, 404, "not_found_error",
     "does not exist"),
    ("count_tokens_no_messages", "/v1/messages/count_tokens", {}, 400, "invalid_request_error", "messages"),
    ("unknown_subpath", "/v1/messages/batches", {}, 404, "not_found_error", ""),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_is_an_anthropic_error_then_the_next_request_works(srv, case):
    _, path, body, status, kind, fragment = case
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) else {"json": body}
    r = httpx.post(f"{srv.url}{path}", timeout=60, **kw)
    assert r.status_code == status, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind, r.text
    assert fragment in r.json()["error"]["message"], r.text
    ok = httpx.post(f"{srv.url}/v1/messages", json={"messages": MSG, "max_tokens": 1}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] == 1


def test_sdk_raises_its_own_errors(srv):
    with pytest.raises(anthropic.BadRequestError):
        client(srv).messages.create(model=srv.model_name, max_tokens=0, messages=MSG)
    with pytest.raises(anthropic.NotFoundError):
        client(srv).messages.create(model="claude-x", max_tokens=1, messages=MSG)


def test_api_key_as_x_api_key():
    """Anthropic's SDKs send the key as x-api-key; a wrong one is Anthropic's 401."""
    from fastapi.testclient import TestClient

    from atom_core.server.app import build_app
    from tests.server.test_hardening import stub_engine

    app = TestClient(build_app(stub_engine(), "m", api_key="k"))
    body = {"messages": MSG}
    wrong = app.post("/v1/messages/count_tokens", json=body, headers={"x-api-key": "nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    # past the key check: the stub model has no tokenizer
    right = app.post("/v1/messages/count_tokens", json=body, headers={"x-api-key": "k"})
    assert right.status_code == 400 and "tokenizer" in right.json()["error"]["message"]
