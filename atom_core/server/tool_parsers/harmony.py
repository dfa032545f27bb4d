"""GPT-OSS harmony output, read as text with its special tokens kept:

    <|channel|>analysis<|message|>thinking<|end|><|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"x": 1}<|call|>
    <|channel|>final<|message|>the answer<|return|>

A message's header (role, `to=` recipient, channel, constraint) ends at <|message|>; its body at
<|end|>, <|call|> or <|return|> (the last two are EOS: the engine drops them from the text, so a
body also ends where the output ends). Text before any header is a message without a channel.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_MARKER = re.compile(r"(<\|start\|>|<\|channel\|>|<\|message\|>|<\|end\|>|<\|call\|>|<\|return\|>)")


@dataclass
class HarmonyMessage:
    channel: str | None
    recipient: str | None
    body: str
    complete: bool  # its end marker (or the end of a final output) has been seen
    header: str = ""  # as written, from <|start|> or <|channel|> up to <|message|>


def stable_text(text: str, final: bool) -> str:
    """Drop a special token still arriving at the end (`<|...` without its `|>`)."""
    if final:
        return text
    if text.endswith("<"):
        return text[:-1]
    cut = text.rfind("<|")
    return text[:cut] if cut >= 0 and "|>" not in text[cut:] else text


def parse_harmony(text: str, final: bool) -> list[HarmonyMessage]:
    text = stable_text(text, final)
    messages: list[HarmonyMessage] = []
    parts = _MARKER.split(text)
    plain = parts[0]
    if plain:
        messages.append(HarmonyMessage(None, None, plain, final or len(parts) > 1))
    header, in_body, current = "", False, None
    for i in range(1, len(parts), 2):
        marker, after = parts[i], parts[i + 1]
        if marker in (START, CHANNEL) and not in_body:
            header += marker + after
        elif marker == MESSAGE and not in_body:
            current = _message(header, after)
            messages.append(current)
            header, in_body = "", True
        elif marker in ENDS and in_body:
            current.complete, in_body = True, False
            header = after  # text between messages is not expected; keep it with the next header
        elif marker == START and in_body:  # a new message without an end marker
            current.complete, in_body, header = True, False, marker + after
        elif in_body:
            current.body += marker + after
        else:
            header += marker + after
    if current is not None and in_body and final:
        current.complete = True
    return messages


def _message(header: str, body: str) -> HarmonyMessage:
    channel = re.search(r"<\|channel\|>\s*(\w+)", header)
    recipient = re.search(r"\bto=([^\s<]+)", header)
    return HarmonyMessage(channel[1] if channel else None, recipient[1] if recipient else None, body, False, header)
