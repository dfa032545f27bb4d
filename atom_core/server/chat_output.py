"""One chat choice's text -> the assistant message: reasoning_content, content and tool_calls.

The reasoning parser (if any) splits first; the tool-call handling then reads the content:
`auto` through the server's tool parser, `required` / a named function from the JSON their
grammar produced. Streaming deltas are differences between parses of the growing text, so they
add up to the non-streamed message.
"""
from __future__ import annotations

import json
import uuid
from typing import Literal

from atom_core.server.reasoning import ReasoningParser
from atom_core.server.tool_parsers import ToolCall, ToolParser, call_from_json

ToolMode = Literal["none", "auto", "required", "named"]
_DECODER = json.JSONDecoder()


def required_calls(text: str) -> list[ToolCall]:
    """The complete elements of the JSON array a `tool_choice: required` grammar produces."""
    body, calls = text.lstrip(), []
    if not body.startswith("["):
        return calls
    pos = 1
    while True:
        while pos < len(body) and body[pos] in " \t\n\r,":
            pos += 1
        if pos >= len(body) or body[pos] == "]":
            return calls
        try:
            obj, pos = _DECODER.raw_decode(body, pos)
        except json.JSONDecodeError:
            return calls  # still arriving (or cut by max_tokens)
        call = call_from_json(obj, ("parameters",))
        if call is None:
            return calls
        calls.append(call)


class ChatOutputParser:
    """Contract: `delta(text, final)` with the choice's whole text so far, once per update;
    `message(text)` for a finished choice (non-streaming). One instance per choice."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, mode: ToolMode,
                 named: str | None = None, parallel: bool = True):
        assert mode != "auto" or tools is not None, "auto tool choice needs a tool parser"
        self.reasoning, self.tools, self.mode, self.named, self.parallel = reasoning, tools, mode, named, parallel
        self.ids: list[str] = []
        self.sent_reasoning = self.sent_content = self.sent_calls = 0
        self.sent_args = -1  # named mode: argument characters streamed (-1: header not sent yet)

    def parse(self, text: str, final: bool) -> tuple[str, str, list[ToolCall]]:
        reasoning, content = self.reasoning.split(text, final) if self.reasoning is not None else ("", text)
        calls: list[ToolCall] = []
        if self.mode == "named":
            calls, content = [ToolCall(self.named, content)], ""
        elif self.mode == "required":
            calls, content = required_calls(content), ""
        elif self.mode == "auto":
            parsed = self.tools.parse(content, final)
            content, calls = parsed.content, parsed.calls
        if not self.parallel:
            calls = calls[:1]
        return reasoning, content, calls

    def _id(self, index: int) -> str:
        while len(self.ids) <= index:
            self.ids.append(f"call_{uuid.uuid4().hex[:24]}")
        return self.ids[index]

    def _call_json(self, index: int, call: ToolCall) -> dict:
        return {"id": self._id(index), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}

    def message(self, text: str) -> dict:
        reasoning, content, calls = self.parse(text, final=True)
        message = {"role": "assistant", "content": content if content or not calls else None}
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning or None
        if calls:
            message["tool_calls"] = [self._call_json(i, c) for i, c in enumerate(calls)]
        return message

    def delta(self, text: str, final: bool) -> dict:
        reasoning, content, calls = self.parse(text, final)
        delta: dict = {}
        if len(reasoning) > self.sent_reasoning:
            delta["reasoning_content"] = reasoning[self.sent_reasoning:]
            self.sent_reasoning = len(reasoning)
        if len(content) > self.sent_content:
            delta["content"] = content[self.sent_content:]
            self.sent_content = len(content)
        if self.mode == "named":  # the text is the arguments: stream them as they come
            args = calls[0].arguments
            if self.sent_args < 0:
                if args or final:
                    delta["tool_calls"] = [{"index": 0, **self._call_json(0, calls[0])}]
                    self.sent_args = len(args)
            elif len(args) > self.sent_args:
                delta["tool_calls"] = [{"index": 0, "function": {"arguments": args[self.sent_args:]}}]
                self.sent_args = len(args)
        elif len(calls) > self.sent_calls:
            delta["tool_calls"] = [{"index": i, **self._call_json(i, calls[i])}
                                   for i in range(self.sent_calls, len(calls))]
            self.sent_calls = len(calls)
        return delta

    def called_tools(self, text: str) -> bool:
        """Whether the finished output called a tool the model chose (finish_reason tool_calls)."""
        return self.mode in ("auto", "required") and bool(self.parse(text, final=True)[2])


class ChatOptions:
    """The server's tool-call and reasoning settings (`--tool-call-parser`,
    `--enable-auto-tool-choice`, `--reasoning-parser`); names are checked on construction."""

    def __init__(self, tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False,
                 reasoning_parser: str | None = None):
        from atom_core.server.reasoning import check_reasoning_parser
        from atom_core.server.tool_parsers import tool_parser_class

        if enable_auto_tool_choice and not tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME")
        self.tool_parser_class = tool_parser_class(tool_call_parser) if tool_call_parser else None
        if reasoning_parser is not None:
            check_reasoning_parser(reasoning_parser)
        self.tool_call_parser = tool_call_parser
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.reasoning_parser = reasoning_parser

    def tool_mode(self, req) -> tuple[ToolMode, str | None]:
        """(mode, function name) for a chat request; APIError-worthy ValueError for auto without the flags."""
        from atom_core.server.structured_request import NamedToolChoice

        if not req.tools:
            return "none", None
        choice = req.tool_choice if req.tool_choice is not None else "auto"
        if isinstance(choice, NamedToolChoice):
            return "named", choice.function.name
        if choice == "auto" and not self.enable_auto_tool_choice:
            raise ValueError('"auto" tool choice needs the server started with --enable-auto-tool-choice '
                             'and --tool-call-parser NAME')
        return choice, None

    def output_parser(self, req, prompt_text: str) -> ChatOutputParser | None:
        """The choice's parser, or None when its text is the content as it is."""
        from atom_core.server.reasoning import make_reasoning_parser

        mode, named = self.tool_mode(req)
        constrained = req._structured is not None  # a grammar shapes the output from its first token
        reasoning = (make_reasoning_parser(self.reasoning_parser, prompt_text, constrained)
                     if self.reasoning_parser else None)
        if mode == "none" and reasoning is None:
            return None
        tools = self.tool_parser_class() if mode == "auto" else None
        return ChatOutputParser(reasoning, tools, mode, named, req.parallel_tool_calls is not False)

    def needs_special_tokens(self, parser: ChatOutputParser | None) -> bool:
        return parser is not None and any(p is not None and p.needs_special_tokens
                                          for p in (parser.reasoning, parser.tools))
