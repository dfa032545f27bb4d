"""The demo model's special tokens and chat format (ChatML), shared by the recipe's scripts.

A conversation renders as
    <|im_start|>user\\nWhat is 47 + 38?<|im_end|>\\n<|im_start|>assistant\\n85<|im_end|>\\n
and a plain-text document as its text followed by <|endoftext|>. No BOS token is ever added:
every training document starts at position 0 with its first real token, as prompts do.
"""

from __future__ import annotations

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, PAD]  # ids 0, 1, 2, 3

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)


def chat_segments(messages: list[dict]) -> list[tuple[str, bool]]:
    """Split a rendered conversation into (text, is_trained) pieces.

    Only the assistant's replies and their closing <|im_end|> carry loss. Pieces break right
    after a newline or a special token, where the pre-tokenizer always breaks too, so encoding
    the pieces one by one gives the same ids as encoding the whole string.
    """
    segments = []
    for m in messages:
        segments.append((f"{IM_START}{m['role']}\n", False))
        segments.append((m["content"] + IM_END, m["role"] == "assistant"))
        segments.append(("\n", False))
    return segments


def render_chat(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """What CHAT_TEMPLATE renders, in plain Python (the tokenizer test checks they agree)."""
    text = "".join(t for t, _ in chat_segments(messages))
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def document_segments(doc: dict) -> list[tuple[str, bool]]:
    if doc["kind"] == "chat":
        return chat_segments(doc["messages"])
    return [(doc["text"] + ENDOFTEXT, True)]


def document_plain_text(doc: dict) -> str:
    """The document's words without special tokens, for training the BPE merges."""
    if doc["kind"] == "chat":
        return "\n".join(f"{m['role']}\n{m['content']}" for m in doc["messages"])
    return doc["text"]
