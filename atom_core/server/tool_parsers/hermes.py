"""Hermes / Qwen2.5 / Qwen3: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one
block per call, content before and between them."""
from __future__ import annotations

import json

from atom_core.server.tool_parsers import MarkedToolParser, ToolCall, call_from_json


class HermesToolParser(MarkedToolParser):
    start = "<tool_call>"
    needs_special_tokens = True  # some tokenizers mark <tool_call> special (vLLM keeps them too)
    end = "</tool_call>"

    def decode(self, body: str) -> list[ToolCall] | None:
        try:
            call = call_from_json(json.loads(body))
        except json.JSONDecodeError:
            return None
        return [call] if call is not None else None
