"""Tool-call parsers and the chat output assembly on fixed model text (no engine).

Every format is checked non-streamed and streamed: the deltas of every way of cutting the text
into pieces must add up to the non-streamed message."""
from __future__ import annotations

import json

import pytest

from atom_core.server.chat_output import ChatOptions, ChatOutputParser, required_calls
from atom_core.server.reasoning import make_reasoning_parser
from atom_core.server.tool_parsers import TOOL_PARSERS, tool_parser_class

WEATHER = '{"city": "Paris", "unit": "C"}'
CASES = {
    "hermes": (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": ' + WEATHER + '}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
        "Let me check.\n\n", [("get_weather", WEATHER), ("get_time", '{"tz": "CET"}')]),
    "llama3_json": (
        '<|python_tag|>{"name": "get_weather", "parameters": ' + WEATHER + '}; {"name": "get_time", "parameters": {"tz": "CET"}}',
        "", [("get_weather", WEATHER), ("get_time", '{"tz": "CET"}')]),
    "deepseek_v3": (
        "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n" + WEATHER
        + "\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{\"tz\": \"CET\"}\n```"
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "Checking.", [("get_weather", WEATHER), ("get_time", '{"tz": "CET"}')]),
    "deepseek_v31": (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>" + WEATHER + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "", [("get_weather", WEATHER)]),
    "openai": (
        "<|channel|>commentary<|message|>Checking the weather.<|end|><|start|>assistant<|channel|>commentary "
        "to=functions.get_weather <|constrain|>json<|message|>" + WEATHER + "<|call|>"
        "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{\"tz\": \"CET\"}",
        "Checking the weather.", [("get_weather", WEATHER), ("get_time", '{"tz": "CET"}')]),
}


def _stream(parser: ChatOutputParser, text: str, cuts: list[int]) -> dict:
    """Feed the text in pieces; merge the deltas the way the OpenAI SDK does."""
    merged = {"content": "", "reasoning_content": "", "tool_calls": {}}
    for end in [*cuts, len(text)]:
        delta = parser.delta(text[:end], final=end == len(text))
        merged["content"] += delta.get("content", "")
        merged["reasoning_content"] += delta.get("reasoning_content", "")
        for call in delta.get("tool_calls", []):
            slot = merged["tool_calls"].setdefault(call["index"], {"id": None, "name": "", "arguments": ""})
            slot["id"] = call.get("id", slot["id"])
            slot["name"] += call.get("function", {}).get("name", "")
            slot["arguments"] += call.get("function", {}).get("arguments", "")
    return merged


def _calls(message: dict) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]


def _cut_patterns(n: int) -> list[list[int]]:
    return [list(range(1, n)), list(range(3, n, 7)), [n // 2], []]


@pytest.mark.parametrize("name", sorted(CASES))
def test_parses_each_format_and_streams_the_same(name):
    text, content, calls = CASES[name]
    parser = ChatOutputParser(None, tool_parser_class(name)(), "auto")
    message = parser.message(text)
    assert _calls(message) == calls
    assert (message["content"] or "") == content
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in message["tool_calls"])
    for cuts in _cut_patterns(len(text)):
        streamed = _stream(ChatOutputParser(None, tool_parser_class(name)(), "auto"), text, cuts)
        assert streamed["content"] == content
        assert [(c["name"], c["arguments"]) for c in streamed["tool_calls"].values()] == calls


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_plain_text_stays_content(name):
    text = "The weather in Paris is sunny."
    message = ChatOutputParser(None, tool_parser_class(name)(), "auto").message(text)
    assert message == {"role": "assistant", "content": text}
    assert _stream(ChatOutputParser(None, tool_parser_class(name)(), "auto"), text, list(range(1, len(text))))["content"] == text


def test_hermes_call_cut_before_its_end_tag_still_parses_at_the_end():
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}'  # the model stopped at EOS before </tool_call>
    assert _calls(ChatOutputParser(None, tool_parser_class("hermes")(), "auto").message(text)) == [("f", '{"a": 1}')]


@pytest.mark.parametrize("text", ['<tool_call>\n{"name": "f", "argu', "<tool_call>not json</tool_call> after"])
def test_hermes_broken_call_is_returned_as_content(text):
    assert ChatOutputParser(None, tool_parser_class("hermes")(), "auto").message(text) == {"role": "assistant", "content": text}
    streamed = _stream(ChatOutputParser(None, tool_parser_class("hermes")(), "auto"), text, list(range(1, len(text))))
    assert streamed["content"] == text and not streamed["tool_calls"]


def test_llama3_json_non_call_object_is_content():
    text = '{"answer": 42}'
    assert ChatOutputParser(None, tool_parser_class("llama3_json")(), "auto").message(text)["content"] == text


def test_parallel_tool_calls_false_keeps_the_first_call():
    text, _, calls = CASES["hermes"]
    assert _calls(ChatOutputParser(None, tool_parser_class("hermes")(), "auto", parallel=False).message(text)) == calls[:1]


def test_required_output_is_a_json_array_of_calls():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    assert [(c.name, c.arguments) for c in required_calls(text)] == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert [c.name for c in required_calls(text[:60])] == ["get_weather"]  # the second is still arriving
    message = ChatOutputParser(None, None, "required").message(text)
    assert message["content"] is None and len(message["tool_calls"]) == 2
    streamed = _stream(ChatOutputParser(None, None, "required"), text, list(range(1, len(text))))
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed["tool_calls"].values()] == \
        [("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_named_function_streams_its_arguments_as_they_come():
    text = '{"city": "Paris"}'
    parser = ChatOutputParser(None, None, "named", "get_weather")
    first = parser.delta(text[:3], final=False)
    assert first["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": text[:3]}
    assert parser.delta(text, final=True)["tool_calls"] == [{"index": 0, "function": {"arguments": text[3:]}}]
    message = ChatOutputParser(None, None, "named", "get_weather").message(text)
    assert _calls(message) == [("get_weather", text)] and message["content"] is None


def test_reasoning_then_tool_calls():
    text = "<think>The user wants weather.</think>\n\n" + CASES["hermes"][0]
    make = lambda: ChatOutputParser(make_reasoning_parser("qwen3", ""), tool_parser_class("hermes")(), "auto")  # noqa: E731
    message = make().message(text)
    assert message["reasoning_content"] == "The user wants weather."
    assert message["content"] == "Let me check.\n\n" and len(message["tool_calls"]) == 2
    streamed = _stream(make(), text, list(range(1, len(text))))
    assert streamed["reasoning_content"] == "The user wants weather." and len(streamed["tool_calls"]) == 2


def test_gpt_oss_reasoning_and_openai_tool_calls():
    text = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
            "to=functions.get_weather <|constrain|>json<|message|>" + WEATHER)
    make = lambda: ChatOutputParser(make_reasoning_parser("gpt_oss", ""), tool_parser_class("openai")(), "auto")  # noqa: E731
    message = make().message(text)
    assert message["reasoning_content"] == "Need the weather."
    assert _calls(message) == [("get_weather", WEATHER)] and message["content"] is None
    streamed = _stream(make(), text, list(range(1, len(text))))
    assert streamed["reasoning_content"] == "Need the weather." and len(streamed["tool_calls"]) == 1


class TestChatOptions:
    def test_unknown_tool_parser_names_the_choices(self):
        with pytest.raises(ValueError, match="unknown tool call parser 'nope'; expected one of: deepseek_v3"):
            ChatOptions(tool_call_parser="nope")

    def test_unknown_reasoning_parser_names_the_choices(self):
        with pytest.raises(ValueError, match="unknown reasoning parser 'nope'; expected one of: deepseek_r1, gpt_oss, qwen3"):
            ChatOptions(reasoning_parser="nope")

    def test_auto_tool_choice_needs_a_parser(self):
        with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
            ChatOptions(enable_auto_tool_choice=True)

    def test_special_tokens_are_kept_for_harmony(self):
        from atom_core.server.protocol import ChatCompletionRequest

        req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                    tools=[{"type": "function", "function": {"name": "f"}}])
        opts = ChatOptions("openai", True)
        assert opts.needs_special_tokens(opts.output_parser(req, ""))
        opts = ChatOptions("llama3_json", True)
        assert not opts.needs_special_tokens(opts.output_parser(req, ""))


def test_tool_call_arguments_reach_the_template_as_a_dict():
    from atom_core.server.protocol import ChatMessage

    msg = ChatMessage(role="assistant", content=None, tool_calls=[
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}])
    assert msg.for_template()["tool_calls"][0]["function"]["arguments"] == {"a": 1}
