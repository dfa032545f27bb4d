"""Reasoning parsers: a model's text -> (reasoning_content, content), chosen by
`--reasoning-parser NAME` (vLLM's names).

Same contract as the tool parsers: `split(text, final)` over the whole output so far returns
only what can no longer change, so streamed deltas add up to the non-streamed response.
"""
from __future__ import annotations

from atom_core.server.tool_parsers import partial_marker
from atom_core.server.tool_parsers.harmony import ENDS, MESSAGE, parse_harmony

REASONING_PARSERS = ("deepseek_r1", "gpt_oss", "qwen3")


class ReasoningParser:
    needs_special_tokens = False

    def split(self, text: str, final: bool) -> tuple[str, str]:
        raise NotImplementedError


class ThinkParser(ReasoningParser):
    """`<think>reasoning</think>content`. The reasoning may start before the output: the chat
    template opened `<think>` (DeepSeek-R1 always; Qwen3 thinking templates) or the model
    writes it first. Without `</think>` the output is still reasoning (cut by max_tokens)."""

    start, end = "<think>", "</think>"

    def __init__(self, starts_in_reasoning: bool):
        self.starts_in_reasoning = starts_in_reasoning

    def split(self, text: str, final: bool) -> tuple[str, str]:
        body = text.lstrip()
        if body.startswith(self.start):
            body, thinking = body[len(self.start):], True
        elif not final and self.start.startswith(body):
            return "", ""  # blank so far, or <think> still arriving
        else:
            body, thinking = text, self.starts_in_reasoning
        if not thinking:
            return "", text
        i = body.find(self.end)
        if i < 0:
            return (body if final else body[: len(body) - partial_marker(body, self.end)]), ""
        return body[:i], body[i + len(self.end):].lstrip("\n")


class GptOssReasoningParser(ReasoningParser):
    """Harmony: the analysis channel is the reasoning. The content keeps everything else: the
    final channel's text, and tool-call messages as written (for the `openai` tool parser)."""

    needs_special_tokens = True

    def split(self, text: str, final: bool) -> tuple[str, str]:
        reasoning, content = [], []
        for m in parse_harmony(text, final):
            if m.channel == "analysis":
                reasoning.append(m.body)
            elif m.recipient:
                content.append(m.header + MESSAGE + m.body + (ENDS[1] if m.complete else ""))
            else:
                content.append(m.body)
        return "".join(reasoning), "".join(content)


def make_reasoning_parser(name: str, prompt_text: str, constrained: bool = False) -> ReasoningParser:
    """constrained: an output grammar applies from the first token, so reasoning is only what the
    output itself opens with <think> (a JSON answer stays content, whatever the template opened)."""
    check_reasoning_parser(name)
    if name == "gpt_oss":
        return GptOssReasoningParser()
    opened = prompt_text.rstrip().endswith(ThinkParser.start)
    return ThinkParser(starts_in_reasoning=not constrained and (opened or name == "deepseek_r1"))


# Families whose chat format always separates reasoning: the server splits it without a flag
# (vLLM does the same for GPT-OSS's Harmony channels).
DEFAULT_REASONING_PARSERS = {"gpt_oss": "gpt_oss"}


def default_reasoning_parser(model_type: str | None) -> str | None:
    """The reasoning parser a checkpoint's `model_type` implies when --reasoning-parser is not given."""
    return DEFAULT_REASONING_PARSERS.get(model_type or "")


def check_reasoning_parser(name: str) -> None:
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser '{name}'; expected one of: {', '.join(REASONING_PARSERS)}")
