"""GPT-OSS (harmony) tool calls: a commentary message addressed `to=functions.NAME` holds the
call's arguments; the content is the final channel's text (and any unaddressed text)."""
from __future__ import annotations

import json

from atom_core.server.tool_parsers import ParsedOutput, ToolCall, ToolParser
from atom_core.server.tool_parsers.harmony import MESSAGE, parse_harmony


class OpenAIToolParser(ToolParser):
    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> ParsedOutput:
        content, calls = [], []
        for m in parse_harmony(text, final):
            if m.recipient and m.recipient.startswith("functions."):
                if not m.complete:
                    break  # later messages cannot be complete either
                call = _call(m.recipient[len("functions."):], m.body)
                if call is None:
                    content.append(m.header + MESSAGE + m.body)
                else:
                    calls.append(call)
            elif m.channel in (None, "final", "commentary"):
                content.append(m.body)
        return ParsedOutput("".join(content), calls)


def _call(name: str, body: str) -> ToolCall | None:
    try:
        args = json.loads(body) if body.strip() else {}
    except json.JSONDecodeError:
        return None
    if not isinstance(args, dict):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))
