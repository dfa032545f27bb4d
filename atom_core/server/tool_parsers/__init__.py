"""Tool-call parsers: a model's text -> OpenAI `tool_calls` plus the remaining content.

One parser per tool-call format, chosen by `--tool-call-parser NAME` (vLLM's names). A parser
reads the whole output so far (`parse(text, final)`); while the output is still growing it
returns only what can no longer change: content up to any partial marker, and complete calls.
Streaming is the difference between two parses (ChatOutputParser in server/chat_output.py), so
the streamed deltas add up to exactly the non-streamed response.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field

# name -> "module:Class" (lazy: only the chosen parser is imported)
TOOL_PARSERS = {
    "hermes": "atom_core.server.tool_parsers.hermes:HermesToolParser",
    "llama3_json": "atom_core.server.tool_parsers.llama3_json:Llama3JsonToolParser",
    "deepseek_v3": "atom_core.server.tool_parsers.deepseek_v3:DeepSeekV3ToolParser",
    "deepseek_v31": "atom_core.server.tool_parsers.deepseek_v3:DeepSeekV3ToolParser",
    "openai": "atom_core.server.tool_parsers.openai:OpenAIToolParser",
}


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text


@dataclass
class ParsedOutput:
    content: str
    calls: list[ToolCall] = field(default_factory=list)


class ToolParser:
    """parse(text, final) -> ParsedOutput. Contract: for a growing text (final=False) each
    result's content is a prefix of the next one's and its calls a prefix of the next calls;
    with final=True a call that never completed is returned as content, as it was written."""

    needs_special_tokens = False  # its markers are special tokens: detokenize with them

    def parse(self, text: str, final: bool) -> ParsedOutput:
        raise NotImplementedError


def tool_parser_class(name: str) -> type[ToolParser]:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser '{name}'; expected one of: {', '.join(sorted(TOOL_PARSERS))}")
    module, cls = TOOL_PARSERS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def partial_marker(text: str, marker: str) -> int:
    """Length of the longest end of `text` that `marker` starts with (a marker still arriving)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def call_from_json(obj, args_keys=("arguments", "parameters")) -> ToolCall | None:
    """{"name": ..., "arguments"/"parameters": {...} or JSON text} -> ToolCall (None if not one)."""
    import json

    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class MarkedToolParser(ToolParser):
    """Calls written between a start and an end marker, content around them (Hermes, DeepSeek).
    A marked span that does not decode stays in the content as written."""

    start = ""
    end = ""

    def decode(self, body: str) -> list[ToolCall] | None:
        raise NotImplementedError

    def parse(self, text: str, final: bool) -> ParsedOutput:
        content, calls, pos = [], [], 0
        while True:
            i = text.find(self.start, pos)
            if i < 0:
                tail = text[pos:]
                content.append(tail if final else tail[: len(tail) - partial_marker(tail, self.start)])
                break
            content.append(text[pos:i])
            j = text.find(self.end, i + len(self.start))
            if j < 0:  # still open: held back; at the end, decoded if it can be (the model stopped at EOS)
                if final:
                    decoded = self.decode(text[i + len(self.start):])
                    content.append(text[i:]) if decoded is None else calls.extend(decoded)
                break
            decoded = self.decode(text[i + len(self.start) : j])
            if decoded is None:
                content.append(text[i : j + len(self.end)])
            else:
                calls.extend(decoded)
            pos = j + len(self.end)
        return ParsedOutput("".join(content), calls)
