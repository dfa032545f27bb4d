"""The processor adapter a vision-language family implements: image -> its encoder's inputs and
placeholder count; chat-templated token ids -> ids with every image's placeholders expanded, and
the request's MultimodalItems. Runs in the API process (the server's tokenizer threads) or in
LLMEngine's process, never in the engine core; needs no torch and no torchvision."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from atom_core.multimodal.inputs import MultimodalItem, content_hash
from atom_core.multimodal.media import load_image


@dataclass(frozen=True)
class ProcessedImage:
    data: dict[str, np.ndarray]  # the family's encoder inputs (MultimodalItem.data)
    num_tokens: int  # placeholder tokens in the prompt == encoder output rows


class ImageProcessor:
    """Base of the per-family adapters (processors/<family>.py).

    The chat template writes `placeholder_token_id` once per image content part (the message part
    it receives is `template_part`); `expand` replaces each by `num_tokens` copies, so HF's
    processor, which expands its text before tokenizing, gives the same ids. A family whose
    placeholder layout differs overrides `expand`.
    """

    family: str = ""
    template_part: dict = {"type": "image"}

    def __init__(self, model_dir: Path, hf_config: dict, tokenizer):
        self.model_dir = Path(model_dir)
        self.hf_config = hf_config
        self.tokenizer = tokenizer
        self.placeholder_token_id = self.read_placeholder_token_id(hf_config, tokenizer)

    def read_placeholder_token_id(self, hf_config: dict, tokenizer) -> int:
        raise NotImplementedError

    @property
    def max_tokens_per_image(self) -> int:
        """Placeholders of the largest image `preprocess` makes (the engine's encoder budget covers one)."""
        raise NotImplementedError

    def preprocess(self, image) -> ProcessedImage:
        """A PIL image (already checked and loaded, multimodal/media.py) -> the encoder's inputs."""
        raise NotImplementedError

    def largest_image_size(self) -> tuple[int, int]:
        """(height, width) in pixels of an image `preprocess` turns into (about) max_tokens_per_image
        placeholders: what the worker encodes when it profiles memory."""
        raise NotImplementedError

    def largest_item(self) -> MultimodalItem:
        """A noise image of the largest size, preprocessed, as an item at offset 0 (content hash 0)."""
        height, width = self.largest_image_size()
        noise = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
        processed = self.preprocess(Image.fromarray(noise))
        return MultimodalItem(0, processed.num_tokens, 0, processed.data)

    def process(self, token_ids: list[int], images: list) -> tuple[list[int], tuple[MultimodalItem, ...]]:
        """Chat-templated ids + the request's images (PIL images, or bytes of any format PIL reads) ->
        expanded ids and items. ValueError for an image that cannot be decoded or is too large."""
        processed = []
        for i, image in enumerate(images):
            try:
                processed.append(self.preprocess(image if isinstance(image, Image.Image) else load_image(image)))
            except ValueError as e:
                raise ValueError(f"image {i}: {e}") from None
        return self.expand(token_ids, processed)

    def expand(self, token_ids: list[int], images: list[ProcessedImage]) -> tuple[list[int], tuple[MultimodalItem, ...]]:
        """The ids with each placeholder token repeated for its image, and the items, in prompt order.
        ValueError when the template wrote a different number of placeholders than there are images."""
        spots = [i for i, t in enumerate(token_ids) if t == self.placeholder_token_id]
        if len(spots) != len(images):
            raise ValueError(f"the prompt holds {len(spots)} image placeholder(s) for {len(images)} image(s); "
                             "each image part of a message must reach the chat template")
        ids: list[int] = []
        items = []
        previous = 0
        for spot, image in zip(spots, images):
            ids.extend(token_ids[previous:spot])
            items.append(MultimodalItem(len(ids), image.num_tokens, content_hash(self.family, image.data), image.data))
            ids.extend([self.placeholder_token_id] * image.num_tokens)
            previous = spot + 1
        ids.extend(token_ids[previous:])
        return ids, tuple(items)
