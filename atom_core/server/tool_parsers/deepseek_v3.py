"""DeepSeek-V3 / R1 and V3.1 tool calls, one block of calls after the content:

V3:   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
V3.1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
"""
from __future__ import annotations

import json
import re

from atom_core.server.tool_parsers import MarkedToolParser, ToolCall

CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_V3 = re.compile(r"\s*function" + SEP + r"(?P<name>[^\n]+)\n```(?:json)?\n(?P<args>.*)\n```\s*$", re.DOTALL)
_V31 = re.compile(r"\s*(?P<name>[^\n<]+?)" + SEP + r"(?P<args>.*)$", re.DOTALL)


class DeepSeekV3ToolParser(MarkedToolParser):
    start = "<｜tool▁calls▁begin｜>"
    needs_special_tokens = True
    end = "<｜tool▁calls▁end｜>"

    def decode(self, body: str) -> list[ToolCall] | None:
        calls = []
        parts = body.split(CALL_BEGIN)
        if parts[0].strip():
            return None
        for part in parts[1:]:
            part = part.strip()
            if not part.endswith(CALL_END):
                return None
            part = part[: -len(CALL_END)]
            match = _V3.match(part) or _V31.match(part)
            if match is None:
                return None
            try:
                args = json.loads(match["args"])
            except json.JSONDecodeError:
                return None
            if not isinstance(args, dict):
                return None
            calls.append(ToolCall(match["name"].strip(), json.dumps(args, ensure_ascii=False)))
        return calls or None
