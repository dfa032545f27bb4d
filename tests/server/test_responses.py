"""The OpenAI Responses API of `atomctl serve` through the OpenAI SDK's `responses` client and
httpx, on the session's demo tools server (hermes, auto tool choice, qwen3 reasoning parser)."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from atom_core.server.chat_output import ChatOutputParser
from atom_core.server.output_blocks import OutputBlocks
from atom_core.server.reasoning import ThinkParser
from atom_core.server.responses import ResponseStore, StoredResponse, _Events, output_item
from tests.server.test_openai_api import engine_idle, wait_until
from tests.server.test_tools import TOOLS

FUNCTIONS = [{"type": "function", **tool["function"]} for tool in TOOLS]  # the Responses API's flat tools
USER = "123 + 456"
# A grammar that cannot end early: long requests for cancel / disconnect tests.
LONG_FORMAT = {"format": {"type": "json_schema", "name": "long", "schema": {
    "type": "object", "properties": {"s": {"type": "string", "minLength": 400}}, "required": ["s"]}}}


@pytest.fixture(scope="module")
def srv(demo_tools_server):
    return demo_tools_server


def chat(srv, messages, **kw):
    return srv.openai().chat.completions.create(model=srv.model_name, messages=messages, temperature=0, **kw)


def aborted(srv) -> float:
    return srv.metrics().get('atom_request_success_total{finished_reason="abort"}', 0)


class TestText:
    def test_greedy_output_equals_chat_completions(self, srv):
        resp = srv.openai().responses.create(model=srv.model_name, input=USER, instructions="Be brief.",
                                             max_output_tokens=10, temperature=0)
        ref = chat(srv, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": USER}], max_tokens=10)
        assert resp.id.startswith("resp_") and resp.object == "response"
        assert resp.output_text == ref.choices[0].message.content
        assert resp.status == ("incomplete" if ref.choices[0].finish_reason == "length" else "completed")
        assert resp.usage.input_tokens == ref.usage.prompt_tokens
        assert resp.usage.output_tokens == ref.usage.completion_tokens
        assert resp.usage.total_tokens == ref.usage.total_tokens
        assert resp.instructions == "Be brief." and resp.max_output_tokens == 10

    def test_stream_events_add_up_to_the_response(self, srv):
        client = srv.openai()
        kw = dict(model=srv.model_name, input=[{"role": "user", "content": [{"type": "input_text", "text": USER}]}],
                  max_output_tokens=8, temperature=0)
        full = client.responses.create(**kw)
        events = list(client.responses.create(**kw, stream=True))
        types = [e.type for e in events]
        assert types[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added", "response.output_text.delta"]
        assert types[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
        assert types[-1] in ("response.completed", "response.incomplete")
        assert [e.sequence_number for e in events] == list(range(len(events)))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == full.output_text == next(e.text for e in events if e.type == "response.output_text.done")
        final = events[-1].response
        assert final.output_text == text and final.usage.output_tokens == full.usage.output_tokens
        added = next(e for e in events if e.type == "response.output_item.added")
        assert added.item.id == final.output[0].id and added.item.status == "in_progress"

    def test_json_schema_format_goes_through_the_grammar(self, srv):
        schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
                  "additionalProperties": False}
        resp = srv.openai().responses.create(model=srv.model_name, input=USER, max_output_tokens=20, temperature=0,
                                             text={"format": {"type": "json_schema", "name": "sum", "schema": schema}})
        assert set(json.loads(resp.output_text)) == {"answer"}
        assert resp.text.format.type == "json_schema"


class TestFunctionTools:
    def test_round_trip_with_previous_response_id_equals_chat(self, srv):
        client = srv.openai()
        first = client.responses.create(model=srv.model_name, input=USER, tools=FUNCTIONS, temperature=0,
                                        tool_choice={"type": "function", "name": "add"}, max_output_tokens=40)
        [call] = first.output
        assert call.type == "function_call" and call.name == "add" and call.call_id.startswith("call_")
        args = json.loads(call.arguments)
        assert set(args) == {"a", "b"}
        second = client.responses.create(model=srv.model_name, previous_response_id=first.id, tools=FUNCTIONS,
                                         tool_choice="none", max_output_tokens=8, temperature=0,
                                         input=[{"type": "function_call_output", "call_id": call.call_id,
                                                 "output": "579"}])
        ref = chat(srv, [{"role": "user", "content": USER},
                         {"role": "assistant", "content": "", "tool_calls": [
                             {"id": call.call_id, "type": "function",
                              "function": {"name": "add", "arguments": call.arguments}}]},
                         {"role": "tool", "tool_call_id": call.call_id, "content": "579"}],
                   tools=TOOLS, tool_choice="none", max_tokens=8)
        assert second.output_text == ref.choices[0].message.content
        assert second.previous_response_id == first.id
        # Sending the output items back by hand is the same conversation.
        by_hand = client.responses.create(model=srv.model_name, tools=FUNCTIONS, tool_choice="none",
                                          max_output_tokens=8, temperature=0,
                                          input=[{"role": "user", "content": USER}, *first.output,
                                                 {"type": "function_call_output", "call_id": call.call_id,
                                                  "output": "579"}])
        assert by_hand.output_text == second.output_text

    def test_streamed_call_arguments_add_up(self, srv):
        events = list(srv.openai().responses.create(
            model=srv.model_name, input=USER, tools=FUNCTIONS, tool_choice={"type": "function", "name": "negate"},
            max_output_tokens=40, temperature=0, stream=True))
        deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        done = next(e for e in events if e.type == "response.function_call_arguments.done")
        assert deltas == done.arguments and set(json.loads(deltas)) == {"x"}
        assert events[-1].response.output[0].arguments == deltas
        assert [e.type for e in events if e.type.startswith("response.output_item")] == [
            "response.output_item.added", "response.output_item.done"]

    def test_required_forces_a_call(self, srv):
        resp = srv.openai().responses.create(model=srv.model_name, input=USER, tools=FUNCTIONS, tool_choice="required",
                                             parallel_tool_calls=False, max_output_tokens=60, temperature=0)
        assert [o.type for o in resp.output] == ["function_call"] and resp.output[0].name in ("add", "negate")


class TestStore:
    def test_retrieve_and_delete(self, srv):
        client = srv.openai()
        resp = client.responses.create(model=srv.model_name, input=USER, max_output_tokens=2, temperature=0)
        assert client.responses.retrieve(resp.id).output_text == resp.output_text
        client.responses.delete(resp.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(resp.id)

    def test_store_false_is_not_kept(self, srv):
        client = srv.openai()
        resp = client.responses.create(model=srv.model_name, input=USER, max_output_tokens=2, store=False)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(resp.id)
        with pytest.raises(openai.NotFoundError) as e:
            client.responses.create(model=srv.model_name, input=USER, previous_response_id=resp.id)
        assert e.value.body["param"] == "previous_response_id"

    def test_background_response_is_cancelled(self, srv):
        client = srv.openai()
        resp = client.responses.create(model=srv.model_name, input=USER, background=True, text=LONG_FORMAT,
                                       max_output_tokens=480)
        assert resp.status == "in_progress" and resp.background
        wait_until(lambda: srv.metrics()["atom_num_requests_running"] == 1, what="the background request to run")
        assert client.responses.cancel(resp.id).status == "cancelled"
        assert client.responses.retrieve(resp.id).status == "cancelled"
        # 480 grammar-forced tokens take minutes on a CPU: idle within seconds means aborted.
        wait_until(lambda: engine_idle(srv), what="the cancelled response's request to leave the core")
        with pytest.raises(openai.BadRequestError, match="only a background response in progress"):
            client.responses.cancel(resp.id)

    def test_background_response_completes(self, srv):
        client = srv.openai()
        resp = client.responses.create(model=srv.model_name, input=USER, background=True, max_output_tokens=3,
                                       temperature=0)
        done = wait_until(lambda: (r := client.responses.retrieve(resp.id)).status != "in_progress" and r,
                          timeout=120, what="the background response")
        assert done.status in ("completed", "incomplete") and done.usage.output_tokens >= 1


class TestDisconnect:
    def test_dropped_stream_is_aborted_and_frees_blocks(self, srv):
        before = aborted(srv)
        body = {"input": USER, "max_output_tokens": 480, "text": LONG_FORMAT, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/responses", json=body, timeout=60) as r:
            assert next(line for line in r.iter_lines() if "response.output_text.delta" in line)
        wait_until(lambda: engine_idle(srv), what="the dropped stream's request to be aborted")
        assert aborted(srv) == before + 1


BAD = [
    # (id, method, path, body, status, param, message fragment)
    ("missing_input", "post", "/v1/responses", {"model": None}, 400, "input", "required"),
    ("empty_input", "post", "/v1/responses", {"input": ""}, 400, "input", "non-empty"),
    ("empty_item_list", "post", "/v1/responses", {"input": []}, 400, "input", "at least 1"),
    ("unknown_item_type", "post", "/v1/responses", {"input": [{"type": "web_search_call"}]}, 400, "input.0", ""),
    ("image_part", "post", "/v1/responses",
     {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input.0", ""),
    ("non_function_tool", "post", "/v1/responses", {"input": "x", "tools": [{"type": "web_search"}]}, 400,
     "tools.0.type", ""),
    ("unknown_field", "post", "/v1/responses", {"input": "x", "reasoning": {"effort": "high"}}, 400, "reasoning",
     "unsupported"),
    ("max_output_tokens_zero", "post", "/v1/responses", {"input": "x", "max_output_tokens": 0}, 400,
     "max_output_tokens", ">= 1"),
    ("output_overflow", "post", "/v1/responses", {"input": "x", "max_output_tokens": 512}, 400, "max_output_tokens",
     "max_model_len"),
    ("input_overflow", "post", "/v1/responses", {"input": "hello " * 600}, 400, "input", "max_model_len"),
    ("top_p_zero", "post", "/v1/responses", {"input": "x", "top_p": 0}, 400, "top_p", ""),
    ("schema_missing", "post", "/v1/responses", {"input": "x", "text": {"format": {"type": "json_schema"}}}, 400,
     "text.format", "schema"),
    ("tool_choice_unknown_function", "post", "/v1/responses",
     {"input": "x", "tools": FUNCTIONS, "tool_choice": {"type": "function", "name": "mul"}}, 400, "tool_choice",
     "not in tools"),
    ("background_without_store", "post", "/v1/responses", {"input": "x", "background": True, "store": False}, 400,
     "background", "store"),
    ("background_stream", "post", "/v1/responses", {"input": "x", "background": True, "stream": True}, 400,
     "stream", ""),
    ("unknown_model", "post", "/v1/responses", {"input": "x", "model": "gpt-9"}, 404, "model", "does not exist"),
    ("unknown_previous", "post", "/v1/responses", {"input": "x", "previous_response_id": "resp_nope"}, 404,
     "previous_response_id", "resp_nope"),
    ("get_unknown", "get", "/v1/responses/resp_nope", None, 404, None, "resp_nope"),
    ("get_stream", "get", "/v1/responses/resp_nope?stream=true", None, 400, "stream", ""),
    ("cancel_unknown", "post", "/v1/responses/resp_nope/cancel", None, 404, None, "resp_nope"),
    ("delete_unknown", "delete", "/v1/responses/resp_nope", None, 404, None, "resp_nope"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_is_an_openai_error_then_the_next_request_works(srv, case):
    _, method, path, body, status, param, fragment = case
    r = httpx.request(method, f"{srv.url}{path}", json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and fragment in error["message"], error
    if param is not None:
        assert error["param"] == param or error["param"].startswith(param + "."), error
    ok = httpx.post(f"{srv.url}/v1/responses", json={"input": USER, "max_output_tokens": 1}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] == 1


# ---- without a server -----------------------------------------------------------------
class TestResponseStore:
    def test_oldest_goes_first_and_reads_refresh(self):
        store = ResponseStore(2)
        for name in ("a", "b"):
            store.put(name, StoredResponse({"id": name}, []))
        store.get("a")
        store.put("c", StoredResponse({"id": "c"}, []))
        assert len(store) == 2 and store.get("a") and store.get("c")
        with pytest.raises(Exception, match="no stored response with id 'b'"):
            store.get("b")

    def test_capacity_must_be_positive(self):
        with pytest.raises(ValueError, match="responses store size 0"):
            ResponseStore(0)


def test_reasoning_becomes_a_reasoning_item_before_the_message():
    """The qwen3 reasoning parser's split, as Responses events and items the SDK parses."""
    from openai.types.responses import ResponseOutputItem, ResponseStreamEvent
    from pydantic import TypeAdapter

    parser = ChatOutputParser(ThinkParser(starts_in_reasoning=False), None, "none")
    text = "<think>Adding.</think>579"
    blocks, events = OutputBlocks(), _Events()
    sse = []
    for end in range(1, len(text) + 1):
        for event in blocks.feed(parser.delta(text[:end], end == len(text))):
            sse += events.block(event)
    for event in blocks.close():
        sse += events.block(event)
    payloads = [TypeAdapter(ResponseStreamEvent).validate_json(s.split("data: ", 1)[1]) for s in sse]
    reasoning = "".join(p.delta for p in payloads if p.type == "response.reasoning_text.delta")
    assert reasoning == "Adding." and "".join(p.delta for p in payloads if p.type == "response.output_text.delta") == "579"
    items = [TypeAdapter(ResponseOutputItem).validate_python(output_item(b, f"x{b.index}", "completed"))
             for b in blocks.blocks]
    assert [i.type for i in items] == ["reasoning", "message"] and items[0].content[0].text == "Adding."
