"""vLLM's random-mm dataset: random text prompts (as the random dataset draws them) each with synthetic
images, for vision-language models over the chat endpoint (--backend openai-chat). The flags take
vLLM's spelling, so one command line runs against both servers:

  --random-mm-base-items-per-request N   images per request (default 1)
  --random-mm-num-mm-items-range-ratio r the count uniform in [N * (1 - r), N * (1 + r)] (default 0)
  --random-mm-limit-mm-per-prompt JSON   at most this many per request, '{"image": K}' (default: no cap)
  --random-mm-bucket-config DICT         {(height, width, frames): probability, ...}; frames 1 = an image
                                         (default vLLM's: {(256, 256, 1): 0.5, (720, 1280, 1): 0.5})

Each image is uniform random pixels, JPEG-encoded into a data: URL (as vLLM sends them), drawn from the
dataset's own seeded RNG. prompt_len counts the text only (the server adds the image tokens).
"""
from __future__ import annotations

import ast
import base64
import io
import json
from dataclasses import replace
from typing import Any

import numpy as np

DEFAULT_BUCKETS = "{(256, 256, 1): 0.5, (720, 1280, 1): 0.5}"


def parse_buckets(text: str) -> list[tuple[tuple[int, int], float]]:
    """vLLM's --random-mm-bucket-config -> [((height, width), probability)], probabilities summing to 1."""
    try:
        buckets = ast.literal_eval(text)
    except (ValueError, SyntaxError) as e:
        raise ValueError(f"invalid --random-mm-bucket-config {text!r}: {e}; expected e.g. {DEFAULT_BUCKETS}") from None
    if not isinstance(buckets, dict) or not buckets:
        raise ValueError(f"invalid --random-mm-bucket-config {text!r}; expected a dict such as {DEFAULT_BUCKETS}")
    out = []
    for key, p in buckets.items():
        if not (isinstance(key, tuple) and len(key) == 3 and all(isinstance(v, int) and v > 0 for v in key)):
            raise ValueError(f"--random-mm-bucket-config key {key!r}: expected (height, width, frames) of positive ints")
        if key[2] != 1:
            raise ValueError(f"--random-mm-bucket-config key {key!r}: only images (frames 1) are served")
        if not isinstance(p, (int, float)) or p < 0:
            raise ValueError(f"--random-mm-bucket-config {key!r}: probability {p!r} must be >= 0")
        out.append(((key[0], key[1]), float(p)))
    total = sum(p for _, p in out)
    if total <= 0:
        raise ValueError("--random-mm-bucket-config: the probabilities sum to 0")
    return [(size, p / total) for size, p in out]


def parse_item_limit(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        limits = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid --random-mm-limit-mm-per-prompt {text!r}: {e}") from None
    if not isinstance(limits, dict) or set(limits) - {"image"}:
        raise ValueError(f'invalid --random-mm-limit-mm-per-prompt {text!r}; expected {{"image": N}}')
    count = limits.get("image")
    if count is not None and (not isinstance(count, int) or count < 0):
        raise ValueError(f"--random-mm-limit-mm-per-prompt image={count!r}: expected an integer >= 0")
    return count


def random_image_url(rng: np.random.Generator, height: int, width: int) -> str:
    from PIL import Image

    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="JPEG")
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def with_images(cfg, texts: list, seed: int) -> list:
    """cfg: a DatasetConfig named random-mm; texts: the random dataset's SampleRequests for it. Each
    gets its images."""
    rng = np.random.default_rng(seed + 1)  # not the text's stream: the same seed gives the same texts
    buckets = parse_buckets(cfg.random_mm_bucket_config)
    base, ratio = cfg.random_mm_base_items_per_request, cfg.random_mm_num_mm_items_range_ratio
    low, high = int(np.floor(base * (1 - ratio))), int(np.ceil(base * (1 + ratio)))
    limit = parse_item_limit(cfg.random_mm_limit_mm_per_prompt)
    if limit is not None:
        high = min(high, limit)
        low = min(low, high)
    out = []
    for request in texts:
        count = int(rng.integers(low, high + 1))
        choice = rng.choice(len(buckets), size=count, p=[p for _, p in buckets]) if count else []
        images = tuple(random_image_url(rng, *buckets[k][0]) for k in choice)
        out.append(replace(request, images=images))
    return out
