"""Llama 3.x JSON tool calls: the whole output is `{"name": ..., "parameters": {...}}` (optionally
after `<|python_tag|>`), several separated by `;`. An output that starts otherwise is content."""
from __future__ import annotations

import json

from atom_core.server.tool_parsers import ParsedOutput, ToolParser, call_from_json

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


class Llama3JsonToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParsedOutput:
        body = text.lstrip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].lstrip()
        elif not final and PYTHON_TAG.startswith(body):
            return ParsedOutput("")  # undecided: blank, or the tag still arriving
        if not body.startswith("{"):
            return ParsedOutput(text if final or body else "")
        calls, pos = [], 0
        while True:
            while pos < len(body) and body[pos] in " \t\n\r;":
                pos += 1
            if pos == len(body):
                return ParsedOutput("", calls)
            try:
                obj, end = _DECODER.raw_decode(body, pos)
            except json.JSONDecodeError:
                # Incomplete (still arriving) or not JSON: at the end, the rest is content.
                return ParsedOutput(body[pos:] if final else "", calls)
            call = call_from_json(obj)
            if call is None:
                return ParsedOutput(body[pos:] if final else "", calls)
            calls.append(call)
            pos = end
