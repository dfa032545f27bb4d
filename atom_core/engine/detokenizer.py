"""Incremental detokenization and stop strings.

Decoding each new token alone breaks multi-byte characters split across tokens and loses
the leading space SentencePiece-style tokenizers attach to a word. So we decode a sliding
window: text(prefix_offset..end) minus text(prefix_offset..read_offset), emitting nothing
while the tail is an incomplete character (U+FFFD). The window starts with a few prompt
tokens for context.

A step's requests are decoded together (`decode_step`): one Rust `decode_batch` call for all
their windows when the tokenizer is a plain HF fast tokenizer (whose `decode` is the backend's
when no clean-up is asked for), instead of two Python `decode` calls per request.
"""
from __future__ import annotations

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """One request's text. Either `add_tokens(ids)`, or the step form used by `decode_step`:
    `append(ids)`, decode both `windows()`, then `advance(prefix_text, new_text)`."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def append(self, token_ids: list[int]) -> None:
        self.ids.extend(token_ids)

    def windows(self) -> tuple[list[int], list[int]]:
        """(the ids already emitted but kept as context, those plus the pending ones)."""
        return self.ids[self.prefix_offset : self.read_offset], self.ids[self.prefix_offset :]

    def advance(self, prefix_text: str, new_text: str) -> str:
        """The decoded windows -> the newly completed text (may be empty)."""
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text) :]

    def add_tokens(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly completed text (may be empty)."""
        self.append(token_ids)
        prefix_ids, all_ids = self.windows()
        return self.advance(self._decode(prefix_ids), self._decode(all_ids))

    def flush(self) -> str:
        """Whatever is still pending at the end of the request (an incomplete character)."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""


def batch_decoder(tokenizer):
    """The Rust tokenizer whose decode_batch equals `tokenizer.decode(..., clean_up_tokenization_spaces=False)`,
    or None when that cannot be known (a slow tokenizer, or a class that overrides decoding)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: decode one by one
        return None
    cls = type(tokenizer)
    if (isinstance(tokenizer, TokenizersBackend) and cls._decode is TokenizersBackend._decode
            and cls.decode is PreTrainedTokenizerBase.decode):
        return tokenizer.backend_tokenizer
    return None


def decode_step(detokenizers: list[IncrementalDetokenizer], backend) -> list[str]:
    """advance() every detokenizer (their new ids already appended); returns their deltas in order.
    backend: batch_decoder(tokenizer) of their common tokenizer, or None (one decode per window)."""
    if backend is None:
        return [d.advance(*map(d._decode, d.windows())) for d in detokenizers]
    texts: list[str | None] = [None] * (2 * len(detokenizers))
    for skip in (True, False):  # decode_batch takes one skip_special_tokens for the batch
        rows = [i for i, d in enumerate(detokenizers) if bool(d.skip_special_tokens) is skip]
        if not rows:
            continue
        windows = []
        for i in rows:
            windows.extend(detokenizers[i].windows())
        decoded = backend.decode_batch(windows, skip_special_tokens=skip)
        for k, i in enumerate(rows):
            texts[2 * i], texts[2 * i + 1] = decoded[2 * k], decoded[2 * k + 1]
    return [d.advance(texts[2 * i], texts[2 * i + 1]) for i, d in enumerate(detokenizers)]


def find_stop(text: str, new_len: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last `new_len` chars of text: (index, stop)."""
    best = None
    for stop in stops:
        start = max(0, len(text) - new_len - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best
