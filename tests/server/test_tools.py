"""Tool calling end to end: `atomctl serve --tool-call-parser NAME --enable-auto-tool-choice` on
the demo model, with the OpenAI SDK over a real socket (streamed and not), for each format:
hermes (the shared demo server, with --reasoning-parser qwen3), llama3_json, deepseek_v3 (with
deepseek_r1) and openai/harmony (with gpt_oss). The demo model was never trained on tools:
`required` and a named function are forced by their JSON grammar (parsed directly, whatever the
server's parser), and for `auto` a guided regex writes the format's own markers, as a model
trained on it would, for the server's parser to read. Harmony is read as text here: the demo
tokenizer has no harmony special tokens and no GPT-OSS model is served in CI."""
from __future__ import annotations

import json
from typing import NamedTuple

import pytest

from atom_core.loader.model_dir import DEMO_MODEL_DIR
from tests.server.conftest import start_server

INT = {"type": "integer", "minimum": 0, "maximum": 999}
TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                      "parameters": {"type": "object", "properties": {"a": INT, "b": INT},
                                                     "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "negate", "parameters": {"type": "object", "properties": {"x": INT},
                                                                        "required": ["x"], "additionalProperties": False}}},
]
KEYS = {"add": {"a", "b"}, "negate": {"x"}}
MESSAGES = [{"role": "user", "content": "123 + 456"}]

ADD_ARGS = r'\{"a": 1[0-9], "b": 2\}'


class Format(NamedTuple):
    flags: tuple[str, ...]  # beyond --tool-call-parser NAME --enable-auto-tool-choice
    regex: str  # an output in the format, as a model trained on it writes it
    reasoning: str | None  # what the reasoning parser takes out of it
    content: str | None
    names: list[str]  # the calls, in order


FORMATS = {
    "hermes": Format(("--reasoning-parser", "qwen3"),
                     r'Sure\.\n<tool_call>\n\{"name": "add", "arguments": ' + ADD_ARGS + r'\}\n</tool_call>',
                     None, "Sure.\n", ["add"]),
    "llama3_json": Format((), r'<\|python_tag\|>\{"name": "add", "parameters": ' + ADD_ARGS
                          + r'\}; \{"name": "negate", "parameters": \{"x": [0-9]\}\}', None, None, ["add", "negate"]),
    "deepseek_v3": Format(("--reasoning-parser", "deepseek_r1"),
                          r"<think>Adding\.</think>Sure\.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add"
                          r"\n```json\n" + ADD_ARGS + r"\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
                          "Adding.", "Sure.", ["add"]),
    "openai": Format(("--reasoning-parser", "gpt_oss"),
                     r"<\|channel\|>analysis<\|message\|>Adding\.<\|end\|><\|start\|>assistant<\|channel\|>commentary "
                     r"to=functions\.add <\|constrain\|>json<\|message\|>" + ADD_ARGS + r"<\|call\|>",
                     "Adding.", None, ["add"]),
}


@pytest.fixture
def server(demo_tools_server):
    return demo_tools_server


@pytest.fixture(scope="module", params=list(FORMATS))
def format_server(request, tmp_path_factory):
    """(parser name, server). Tests are grouped by parser, so one extra server runs at a time;
    hermes is the session's shared demo server."""
    name = request.param
    if name == "hermes":
        yield name, request.getfixturevalue("demo_tools_server")
        return
    srv = start_server(DEMO_MODEL_DIR, tmp_path_factory.mktemp(f"tools_{name}"), "--tool-call-parser", name,
                       "--enable-auto-tool-choice", *FORMATS[name].flags)
    yield name, srv
    srv.stop()


class Reply(NamedTuple):
    reasoning: str | None
    content: str | None
    calls: list[tuple[str, str, str]]  # (id, name, arguments)
    finish_reason: str | None


def _create(server, stream: bool, **kw) -> Reply:
    """The choice's message; streamed chunks merged as the SDK's helpers do."""
    client = server.openai()
    kw = dict(model=server.model_name, messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=80) | kw
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return Reply(getattr(choice.message, "reasoning_content", None), choice.message.content, calls,
                     choice.finish_reason)
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        for c in delta.tool_calls or []:
            slot = calls.setdefault(c.index, ["", "", ""])
            slot[0] = c.id or slot[0]
            slot[1] += (c.function.name or "") if c.function else ""
            slot[2] += (c.function.arguments or "") if c.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return Reply(reasoning or None, content or None, [tuple(v) for _, v in sorted(calls.items())], finish)


class TestEachFormat:
    @pytest.mark.parametrize("stream", [False, True])
    def test_required_forces_a_call(self, format_server, stream):
        _, srv = format_server
        # One call: the demo model, never trained on tools, would otherwise keep adding calls to max_tokens.
        reply = _create(srv, stream, tool_choice="required", parallel_tool_calls=False)
        assert len(reply.calls) == 1 and reply.finish_reason == "tool_calls" and not reply.content, reply
        for call_id, name, arguments in reply.calls:
            assert call_id.startswith("call_") and name in KEYS
            args = json.loads(arguments)
            assert set(args) == KEYS[name] and all(type(v) is int for v in args.values())

    @pytest.mark.parametrize("stream", [False, True])
    def test_named_function_is_called_with_its_schema(self, format_server, stream):
        _, srv = format_server
        reply = _create(srv, stream, tool_choice={"type": "function", "function": {"name": "negate"}})
        assert len(reply.calls) == 1 and reply.calls[0][1] == "negate" and reply.finish_reason == "stop", reply
        assert set(json.loads(reply.calls[0][2])) == {"x"} and not reply.content

    @pytest.mark.parametrize("stream", [False, True])
    def test_auto_parses_the_models_output_in_the_servers_format(self, format_server, stream):
        name, srv = format_server
        fmt = FORMATS[name]
        # The demo tokenizer spells each marker in several tokens: up to ~160 here.
        reply = _create(srv, stream, tool_choice="auto", max_tokens=300, extra_body={"guided_regex": fmt.regex})
        assert (reply.reasoning, reply.content, reply.finish_reason) == (fmt.reasoning, fmt.content, "tool_calls"), reply
        assert [n for _, n, _ in reply.calls] == fmt.names
        for call_id, call_name, arguments in reply.calls:
            assert call_id.startswith("call_") and set(json.loads(arguments)) == KEYS[call_name]
        assert len({call_id for call_id, _, _ in reply.calls}) == len(reply.calls)


def test_auto_without_a_call_is_plain_content(server):
    reply = _create(server, False, max_tokens=8)  # tool_choice defaults to auto with tools
    assert reply.content and not reply.calls and reply.finish_reason in ("stop", "length")


def test_none_ignores_tools(server):
    reply = _create(server, False, tool_choice="none", max_tokens=8)
    assert reply.content and not reply.calls


def test_tool_results_go_back_to_the_template(server):
    messages = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 123, "b": 456}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "579"}]
    assert _create(server, False, messages=messages, tool_choice="none", max_tokens=8).content is not None


@pytest.mark.parametrize("body,param,match", [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}}, "tool_choice", "not in tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", None),
    ({"tools": TOOLS * 2}, "tools", "unique"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "only one"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name", None),
])
def test_bad_tool_requests_are_a_400(server, body, param, match):
    import httpx

    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": MESSAGES, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert match is None or match in err["message"], err


def test_auto_needs_the_server_flags():
    from atom_core.server.chat_output import ChatOptions
    from atom_core.server.protocol import ChatCompletionRequest

    no_tools = ChatCompletionRequest(messages=MESSAGES, tool_choice="auto")  # nothing to call: plain chat
    assert ChatOptions().output_parser(no_tools, "") is None

    req = ChatCompletionRequest(messages=MESSAGES, tools=TOOLS)  # tool_choice defaults to auto
    with pytest.raises(ValueError, match="--enable-auto-tool-choice"):
        ChatOptions().output_parser(req, "")
    assert ChatOptions("hermes", True).output_parser(req, "").mode == "auto"


class TestCli:
    @pytest.mark.parametrize("args,message", [
        (["--tool-call-parser", "nope"], "unknown tool call parser 'nope'; expected one of: deepseek_v3"),
        (["--reasoning-parser", "nope"], "unknown reasoning parser 'nope'"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    ])
    def test_bad_flags_fail_before_the_engine_starts(self, monkeypatch, args, message):
        import typer
        from typer.testing import CliRunner

        import atom_core.server.app as server_app
        from atomctl.serve import register

        monkeypatch.setattr(server_app, "run_server", lambda *a, **k: pytest.fail("the server must not start"))
        app = typer.Typer()
        register(app)
        app.callback()(lambda: None)
        result = CliRunner().invoke(app, ["serve", "--model", "/m", *args])
        assert result.exit_code != 0 and message in result.output

    def test_flags_reach_the_server(self, monkeypatch):
        import typer
        from typer.testing import CliRunner

        import atom_core.server.app as server_app
        from atomctl.serve import register

        seen = {}
        monkeypatch.setattr(server_app, "run_server", lambda *a, **k: seen.update(k))
        app = typer.Typer()
        register(app)
        app.callback()(lambda: None)
        result = CliRunner().invoke(app, ["serve", "--model", "/m", "--tool-call-parser", "openai",
                                          "--enable-auto-tool-choice", "--reasoning-parser", "gpt_oss"])
        assert result.exit_code == 0, result.output
        opts = seen["chat_options"]
        assert (opts.tool_call_parser, opts.enable_auto_tool_choice, opts.reasoning_parser) == ("openai", True, "gpt_oss")
