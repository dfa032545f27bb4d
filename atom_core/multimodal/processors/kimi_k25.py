"""Kimi-K2.5's image preprocessing, giving the pixels of transformers' Kimi_K25ImageProcessor without
torchvision (that processor has no PIL path and imports torchvision at module level).

transformers' steps, each reproduced here: RGB conversion (alpha composited on white:
`transformers.image_transforms.convert_to_rgb`, which needs no torchvision); `navit_resize` (shrink, never
enlarge, to at most `max_patches` patches and `max_size_per_side` patches a side, then pad each side up to a
multiple of patch_size * merge_size); the resize itself, which torchvision runs on a uint8 CPU tensor as
`torch.nn.functional.interpolate(mode="bicubic", antialias=True, align_corners=False)` (called the same way
here: PIL's bicubic differs by one level on some pixels); zero padding at the bottom and right, in uint8;
then (x - 255 * mean) / (255 * std) in float32 and the patch layout [gh * gw, 3, p, p], row-major.

The last two steps run on the device in the model (models/kimi_k25.py): an item carries the padded uint8
image and the fused mean / std, so a request pickles a quarter of the bytes. The chat template writes one
`<|media_pad|>` per image; it stands for gh * gw / merge_size² tokens (the base class's `expand`).

Settings come from preprocessor_config.json: transformers' format (max_patches, size.max_height, merge_size,
...) or the published checkpoint's `media_proc_cfg` (in_patch_limit, patch_limit_on_one_side,
merge_kernel_size, ...); an absent file means transformers' defaults, which are the published values.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from atom_core.multimodal.processors.base import ImageProcessor, ProcessedImage

IMAGE_TOKEN = "<|media_pad|>"
BICUBIC = 3  # PIL's (and transformers' PILImageResampling) number for bicubic


@dataclass(frozen=True)
class KimiImageSettings:
    patch_size: int = 14
    merge_size: int = 2
    max_patches: int = 16384
    max_size_per_side: int = 512  # in patches
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255

    def resized_and_padded(self, height: int, width: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """transformers' navit_resize, float for float: ((resized h, w), (padded h, w)) in pixels."""
        p = self.patch_size
        patches = max(1.0, height // p) * max(1.0, width // p)
        scale = min(1.0, math.sqrt(self.max_patches / patches), self.max_size_per_side * p / height,
                    self.max_size_per_side * p / width)
        new_h = min(max(1, int(height * scale)), self.max_size_per_side * p)
        new_w = min(max(1, int(width * scale)), self.max_size_per_side * p)
        factor = self.merge_size * p
        return (new_h, new_w), (new_h + (factor - new_h % factor) % factor, new_w + (factor - new_w % factor) % factor)

    def max_tokens(self) -> int:
        """An upper bound on any image's placeholder count (the engine's encoder budget must hold one).

        With s the scale and fh = h // p, the resized side is a = h * s / p < fh * s + 1 patches (h < p * (fh + 1),
        s <= 1), likewise b < fw * s + 1, where (fh * s) * (fw * s) <= max_patches (s is at most the patch-budget
        scale) and a, b <= L = max_size_per_side; padding adds under m = merge_size patches a side. So the token
        count (A / m) * (B / m) is below (u + m)(v + m) / m² over u, v <= L with (u - 1)(v - 1) <= max_patches,
        largest at u = L; and never more than ceil(L / m)² (each side padded to at most ceil(L / m) * m)."""
        side, m = self.max_size_per_side, self.merge_size
        other = side - 1 if side == 1 else min(side - 1, self.max_patches / (side - 1))
        return min(math.ceil(side / m) ** 2, int((side + m) * (other + 1 + m) / m ** 2))

    def fused_mean_std(self) -> tuple[np.ndarray, np.ndarray]:
        """mean / rescale_factor and std / rescale_factor as transformers fuses them: a float32 tensor
        times a Python float."""
        import torch

        scale = 1.0 / self.rescale_factor
        return ((torch.tensor(self.image_mean) * scale).numpy(), (torch.tensor(self.image_std) * scale).numpy())


_REFUSED_IF_FALSE = ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb")


def read_settings(model_dir: Path) -> KimiImageSettings:
    """The model directory's preprocessor_config.json as settings; ValueError for an option whose
    pixels this path does not produce."""
    path = Path(model_dir) / "preprocessor_config.json"
    if not path.exists():
        return KimiImageSettings()
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    published = raw.get("media_proc_cfg")
    if published is not None:
        if published.get("fixed_output_tokens") is not None:
            raise ValueError(f"{path}: media_proc_cfg.fixed_output_tokens is not supported; expected null")
        return KimiImageSettings(
            patch_size=int(published.get("patch_size", 14)), merge_size=int(published.get("merge_kernel_size", 2)),
            max_patches=int(published.get("in_patch_limit", 16384)),
            max_size_per_side=int(published.get("patch_limit_on_one_side", 512)),
            image_mean=tuple(published.get("image_mean", (0.5,) * 3)),
            image_std=tuple(published.get("image_std", (0.5,) * 3)))
    for name in _REFUSED_IF_FALSE:
        if raw.get(name, True) is not True:
            raise ValueError(f"{path}: {name}={raw[name]!r} is not supported for Kimi-K2.5 images; expected true")
    if raw.get("resample", BICUBIC) != BICUBIC:
        raise ValueError(f"{path}: resample={raw['resample']!r} is not supported; expected {BICUBIC} (bicubic)")
    size = raw.get("size") or {"max_height": 512, "max_width": 512}
    if size.get("max_height") is None or size.get("max_height") != size.get("max_width"):
        raise ValueError(f"{path}: size must hold equal max_height and max_width, got {size}")
    defaults = KimiImageSettings()
    return KimiImageSettings(
        patch_size=int(raw.get("patch_size", defaults.patch_size)),
        merge_size=int(raw.get("merge_size", defaults.merge_size)),
        max_patches=int(raw.get("max_patches", defaults.max_patches)), max_size_per_side=int(size["max_height"]),
        image_mean=tuple(raw.get("image_mean", defaults.image_mean)),
        image_std=tuple(raw.get("image_std", defaults.image_std)),
        rescale_factor=float(raw.get("rescale_factor", defaults.rescale_factor)))


def resize_uint8(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    """[H, W, 3] uint8 -> [height, width, 3] uint8, the call torchvision's resize makes for a uint8 CPU image."""
    import torch
    import torch.nn.functional as F

    if rgb.shape[:2] == (height, width):
        return rgb
    image = torch.from_numpy(rgb).permute(2, 0, 1).contiguous()[None]  # torchvision's layout: contiguous NCHW
    out = F.interpolate(image, size=(height, width), mode="bicubic", align_corners=False, antialias=True)
    return out[0].permute(1, 2, 0).numpy()


class KimiK25ImageProcessor(ImageProcessor):
    """data: `pixels` uint8 [padded h, padded w, 3], `grid_thw` int64 [3] (1, h / p, w / p), `mean` and
    `std` float32 [3] (fused with the rescale: subtract from and divide the 0..255 values)."""

    family = "kimi_k25"
    template_part = {"type": "image"}

    def __init__(self, model_dir: Path, hf_config: dict, tokenizer):
        super().__init__(model_dir, hf_config, tokenizer)
        self.settings = read_settings(model_dir)
        vision = hf_config.get("vision_config") or {}
        for ours, theirs in (("patch_size", "patch_size"), ("merge_size", "merge_kernel_size")):
            value = vision.get(theirs)
            expected = getattr(self.settings, ours)
            if isinstance(value, (list, tuple)):
                value = value[0] if len(set(value)) == 1 else value
            if value is not None and value != expected:
                raise ValueError(f"preprocessor {ours} {expected} differs from vision_config.{theirs} {value}")

    @property
    def max_tokens_per_image(self) -> int:
        return self.settings.max_tokens()

    def read_placeholder_token_id(self, hf_config: dict, tokenizer) -> int:
        """The config's id (media_placeholder_token_id in the published file, image_token_id in transformers'),
        which must be the tokenizer's <|media_pad|> when the tokenizer has that token."""
        token_id = hf_config.get("media_placeholder_token_id", hf_config.get("image_token_id", 163605))
        vocab = tokenizer.get_vocab() if tokenizer is not None else {}
        if IMAGE_TOKEN in vocab and vocab[IMAGE_TOKEN] != token_id:
            raise ValueError(f"the config's image token id {token_id} is not the tokenizer's {IMAGE_TOKEN} "
                             f"({vocab[IMAGE_TOKEN]})")
        return int(token_id)

    def largest_image_size(self) -> tuple[int, int]:
        side = self.settings.max_size_per_side * self.settings.patch_size  # navit_resize scales it to the patch budget
        return side, side

    def preprocess(self, image) -> ProcessedImage:
        from transformers.image_transforms import convert_to_rgb

        s = self.settings
        rgb = convert_to_rgb(image, return_numpy=True)
        (height, width), (padded_h, padded_w) = s.resized_and_padded(*rgb.shape[:2])
        pixels = np.zeros((padded_h, padded_w, 3), dtype=np.uint8)
        pixels[:height, :width] = resize_uint8(rgb, height, width)
        grid = np.array([1, padded_h // s.patch_size, padded_w // s.patch_size], dtype=np.int64)
        mean, std = s.fused_mean_std()
        return ProcessedImage({"pixels": pixels, "grid_thw": grid, "mean": mean, "std": std},
                              int(grid[1] * grid[2]) // s.merge_size ** 2)
