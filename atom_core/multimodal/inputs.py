"""What a request carries per image, from the API process to the worker: plain data (numpy, no
torch), pickled across the process boundary like the prompt's token ids.

The prompt's token ids already hold each image's placeholder tokens (the processor adapter
expanded them); a `MultimodalItem` says where they are, what the encoder reads for them, and the
image's content hash, which keys the encoder-output cache and enters the prefix-cache block hashes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np


@dataclass(frozen=True, eq=False)
class MultimodalItem:
    """One image of one request.

    Its placeholder tokens are prompt positions [offset, offset + length), one contiguous run;
    the family's encoder turns `data` into exactly `length` rows of the text model's hidden size,
    which replace those positions' token embeddings. `data` is the family's own encoder input
    (Qwen3.5: the resized uint8 image and its patch grid, processors/qwen3_5.py), never read by
    the engine. `content_hash` covers the family and every array of `data` (shape, dtype, bytes):
    two items with one hash give the same encoder output.
    """

    offset: int
    length: int
    content_hash: int
    data: dict[str, np.ndarray] = field(repr=False)
    modality: Literal["image"] = "image"

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        """Whether prompt positions [start, end) include any of its placeholders."""
        return self.offset < end and start < self.end


def content_hash(family: str, data: dict[str, np.ndarray]) -> int:
    """xxhash64 of the family name and each array's name, dtype, shape and bytes, in name order."""
    import xxhash  # here, not at import: model files import this module in plugin mode, where vLLM's
    # environment holds atomctl without its dependencies (pip install --no-deps beside vLLM)

    h = xxhash.xxh64(family.encode())
    for name in sorted(data):
        array = np.ascontiguousarray(data[name])
        h.update(f"|{name}|{array.dtype.str}|{array.shape}|".encode())
        h.update(array.data)
    return h.intdigest()


def encoder_cache_rows(max_num_batched_tokens: int, max_image_tokens: int) -> int:
    """The encoder-output cache's size in rows: what a step may encode (as many rows as it schedules
    tokens) or one largest image, as vLLM's encoder budget."""
    return max(max_num_batched_tokens, max_image_tokens)


def check_items(items: tuple[MultimodalItem, ...] | list[MultimodalItem], num_prompt_tokens: int) -> None:
    """ValueError unless the items' placeholder runs lie in the prompt, in order, without overlap."""
    end = 0
    for i, item in enumerate(items):
        if item.length < 1 or item.offset < end or item.end > num_prompt_tokens:
            raise ValueError(f"image {i}: placeholder tokens [{item.offset}, {item.end}) must be non-empty, in "
                             f"order and inside the prompt's {num_prompt_tokens} tokens")
        end = item.end


def block_extra_keys(items: tuple[MultimodalItem, ...], start: int, end: int) -> tuple[tuple[int, int], ...]:
    """(content hash, offset) of each item with placeholders in token positions [start, end): what a
    prefix-cache block over those tokens hashes besides them (the placeholder ids are the same for
    every image, so the tokens alone cannot tell two images apart)."""
    return tuple((item.content_hash, item.offset) for item in items if item.overlaps(start, end))
