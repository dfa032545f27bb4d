"""Tool calling end to end: `atomctl serve --tool-call-parser hermes --enable-auto-tool-choice`
on the demo model, with the OpenAI SDK over a real socket (streamed and not). The demo model
was never trained on tools: every call here is forced by a grammar (tool_choice required or
named), or for `auto` written in Hermes format by a guided regex, then parsed."""
from __future__ import annotations

import json

import pytest

from atom_core.loader.model_dir import DEMO_MODEL_DIR

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


@pytest.fixture
def server(demo_tools_server):
    return demo_tools_server


def _create(server, stream: bool, **kw):
    """(message-like dict, finish_reason), streamed chunks merged as the SDK's helpers do."""
    client = server.openai()
    kw = dict(model=server.model_name, messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=80) | kw
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or []:
            slot = calls.setdefault(c.index, ["", "", ""])
            slot[0] = c.id or slot[0]
            slot[1] += (c.function.name or "") if c.function else ""
            slot[2] += (c.function.arguments or "") if c.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return content or None, [tuple(v) for _, v in sorted(calls.items())], finish


@pytest.mark.parametrize("stream", [False, True])
def test_required_forces_a_call(server, stream):
    # One call: the demo model, never trained on tools, would otherwise keep adding calls to max_tokens.
    content, calls, finish = _create(server, stream, tool_choice="required", parallel_tool_calls=False)
    assert len(calls) == 1 and finish == "tool_calls" and not content
    for call_id, name, arguments in calls:
        assert call_id.startswith("call_") and name in KEYS
        args = json.loads(arguments)
        assert set(args) == KEYS[name] and all(type(v) is int for v in args.values())


@pytest.mark.parametrize("stream", [False, True])
def test_named_function_is_called_with_its_schema(server, stream):
    content, calls, finish = _create(server, stream, tool_choice={"type": "function", "function": {"name": "negate"}})
    assert len(calls) == 1 and calls[0][1] == "negate" and finish == "stop"
    assert set(json.loads(calls[0][2])) == {"x"}


def test_auto_parses_the_models_hermes_output(server):
    """Streamed (the harder path; the non-streamed parse of the same text is in test_tools_parsers)."""
    regex = r'Sure\.\n<tool_call>\n\{"name": "add", "arguments": \{"a": 1[0-9], "b": 2\}\}\n</tool_call>'
    content, calls, finish = _create(server, True, tool_choice="auto", extra_body={"guided_regex": regex})
    assert content == "Sure.\n" and finish == "tool_calls"
    assert [(n, set(json.loads(a))) for _, n, a in calls] == [("add", {"a", "b"})]


def test_auto_without_a_call_is_plain_content(server):
    content, calls, finish = _create(server, False, max_tokens=8)  # tool_choice defaults to auto with tools
    assert content and not calls and finish in ("stop", "length")


def test_none_ignores_tools(server):
    content, calls, _ = _create(server, False, tool_choice="none", max_tokens=8)
    assert content and not calls


def test_tool_results_go_back_to_the_template(server):
    messages = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 123, "b": 456}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "579"}]
    content, _, _ = _create(server, False, messages=messages, tool_choice="none", max_tokens=8)
    assert content is not None


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
