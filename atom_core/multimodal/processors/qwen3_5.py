"""Qwen3.5's image processing without torchvision: HF's Qwen2VL image processor (the PIL backend,
Qwen2VLImageProcessorPil) split in two. Here, in the API process: RGB, then the "smart" resize (both
sides multiples of patch_size * merge_size, the pixel count within the processor's bounds, bicubic).
On the device (models/qwen3_5_vision.py: pixel_patches): rescale, normalise, patchify. The item ships
the resized uint8 image (a quarter of the float32 patches' bytes, which also repeat each frame twice).
The placeholder: the chat template writes <|vision_start|><|image_pad|><|vision_end|> per image;
<|image_pad|> becomes one token per 2x2 block of patches, as Qwen3VLProcessor expands it."""
from __future__ import annotations

import json
import math

import numpy as np
from PIL import Image

from atom_core.multimodal.media import to_rgb
from atom_core.multimodal.processors.base import ImageProcessor, ProcessedImage

_RESAMPLE = {0: Image.Resampling.NEAREST, 1: Image.Resampling.LANCZOS, 2: Image.Resampling.BILINEAR,
             3: Image.Resampling.BICUBIC, 4: Image.Resampling.BOX, 5: Image.Resampling.HAMMING}


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """HF's smart_resize: the size nearest (height, width) with both sides multiples of factor and
    min_pixels <= h * w <= max_pixels, keeping the aspect ratio as closely as it can."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"the image's aspect ratio {max(height, width) / min(height, width):.0f}:1 is over 200:1")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class Qwen3_5ImageProcessor(ImageProcessor):
    family = "qwen3_5"

    def __init__(self, model_dir, hf_config: dict, tokenizer):
        super().__init__(model_dir, hf_config, tokenizer)
        path = self.model_dir / "preprocessor_config.json"
        try:
            pre = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read {path} (the image processor's settings): {e}") from e
        vision = hf_config.get("vision_config") or {}
        self.patch_size = int(pre.get("patch_size", vision.get("patch_size", 16)))
        self.merge_size = int(pre.get("merge_size", vision.get("spatial_merge_size", 2)))
        temporal = int(pre.get("temporal_patch_size", vision.get("temporal_patch_size", 2)))
        for name, ours, theirs in (("patch_size", self.patch_size, vision.get("patch_size")),
                                   ("merge_size", self.merge_size, vision.get("spatial_merge_size")),
                                   ("temporal_patch_size", temporal, vision.get("temporal_patch_size"))):
            if theirs is not None and ours != theirs:
                raise ValueError(f"{path}: {name} {ours} differs from the vision tower's {theirs}")
        size = pre.get("size") or {}
        self.min_pixels = int(pre.get("min_pixels") or size.get("shortest_edge") or 56 * 56)
        self.max_pixels = int(pre.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280)
        self.mean = np.asarray(pre.get("image_mean", [0.48145466, 0.4578275, 0.40821073]), dtype=np.float32)
        self.std = np.asarray(pre.get("image_std", [0.26862954, 0.26130258, 0.27577711]), dtype=np.float32)
        resample = pre.get("resample", 3)
        if resample not in _RESAMPLE:
            raise ValueError(f"{path}: unsupported resample {resample!r}; expected one of {sorted(_RESAMPLE)}")
        self.resample = _RESAMPLE[resample]
        if pre.get("do_rescale") is False or pre.get("do_normalize") is False or pre.get("do_resize") is False:
            raise ValueError(f"{path}: do_resize, do_rescale and do_normalize must be on (the only layout served)")

    def read_placeholder_token_id(self, hf_config: dict, tokenizer) -> int:
        token_id = hf_config.get("image_token_id")
        if token_id is None and tokenizer is not None:
            token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
        if token_id is None:
            raise ValueError("config.json names no image_token_id and there is no tokenizer to find <|image_pad|>")
        return int(token_id)

    @property
    def max_tokens_per_image(self) -> int:
        factor = self.patch_size * self.merge_size
        return self.max_pixels // (factor * factor)

    def largest_image_size(self) -> tuple[int, int]:
        # a x b merged patches with a * b as near max_tokens_per_image as a near-square can be; sides
        # already multiples of the factor, so smart_resize keeps them
        factor = self.patch_size * self.merge_size
        tokens = self.max_tokens_per_image
        a = max(1, math.isqrt(tokens))
        return a * factor, (tokens // a) * factor

    def resized(self, image: Image.Image) -> np.ndarray:
        """The RGB image at its processing size: uint8 [H, W, 3]."""
        factor = self.patch_size * self.merge_size
        height, width = smart_resize(image.height, image.width, factor, self.min_pixels, self.max_pixels)
        return np.array(image.resize((width, height), resample=self.resample), dtype=np.uint8)

    def preprocess(self, image: Image.Image) -> ProcessedImage:
        pixels = self.resized(image if image.mode == "RGB" else to_rgb(image))
        grid = np.array([1, pixels.shape[0] // self.patch_size, pixels.shape[1] // self.patch_size], dtype=np.int64)
        data = {"pixels": pixels, "grid_thw": grid, "image_mean": self.mean, "image_std": self.std}
        return ProcessedImage(data, int(grid.prod()) // self.merge_size**2)
