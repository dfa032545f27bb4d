"""Kimi-K2.5's vision tower + projector at the published sizes (27 blocks of 1152, 16 heads, 14-pixel patches,
2x2 merge to 7168), random weights, on one GPU: milliseconds per encode of a batch of images, ours
(models/kimi_k25_vision.py) against transformers' Kimi_K25VisionModel + projector (SDPA; its own random
weights: speed only), and the preprocessing (multimodal/processors/kimi_k25.py) per image on the CPU. What an
image adds to TTFT.

`python -m benchmarks.engine.kimi_k25_vision_bench --size 1024x1024 --images 1,8 --dtype bfloat16`
"""
from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import numpy as np
import torch


def _configs():
    import transformers as tf

    vision = tf.Kimi_K25VisionConfig()  # transformers' defaults are the published tower's sizes
    outer = tf.Kimi_K25Config(vision_config=vision.to_dict(),
                              text_config={"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 1})
    return outer, SimpleNamespace(vision_config=vision, hidden_size=7168, projection_hidden_size=1152)


def _time(fn, iters: int, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) / iters * 1e3


@torch.inference_mode()
def main() -> None:
    import transformers as tf
    from PIL import Image

    from atom_core.models.kimi_k25 import image_patches
    from atom_core.models.kimi_k25_vision import KimiProjector, KimiVisionTower, kimi_vision_dims
    from atom_core.multimodal.inputs import MultimodalItem
    from atom_core.multimodal.processors.kimi_k25 import KimiImageSettings, KimiK25ImageProcessor

    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="1024x1024", help="image width x height in pixels")
    parser.add_argument("--images", default="1,8", help="images per encode (comma-separated)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--device", default="cuda", help="cuda (what it is for), or cpu for a smoke run")
    args = parser.parse_args()
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    width, height = (int(v) for v in args.size.split("x"))

    processor = KimiK25ImageProcessor.__new__(KimiK25ImageProcessor)  # settings only: no model directory
    processor.settings = KimiImageSettings()
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8))
    start = time.perf_counter()
    processed = processor.preprocess(image)
    prep_ms = (time.perf_counter() - start) * 1e3
    item = MultimodalItem(0, processed.num_tokens, 0, processed.data)
    grid = tuple(int(x) for x in processed.data["grid_thw"])
    print(f"{width}x{height}: grid {grid}, {processed.num_tokens} tokens; preprocessing {prep_ms:.1f} ms (CPU)")

    outer, ours_config = _configs()
    dims = kimi_vision_dims(ours_config)
    torch.manual_seed(0)
    with torch.device(device):
        hf_tower = tf.Kimi_K25VisionModel(outer.vision_config).to(dtype).eval()
        hf_proj = tf.models.kimi_k25.modeling_kimi_k25.Kimi_K25MultimodalProjection(outer).to(dtype).eval()
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        tower, projector = KimiVisionTower(dims), KimiProjector(dims)
        torch.set_default_dtype(old)
    from atom_core.loader.model_loader import process_weights_after_loading

    for module in (tower, projector):
        for param in module.parameters():
            param.data.normal_(0, 0.02)
        process_weights_after_loading(module)
    for n in [int(v) for v in args.images.split(",")]:
        items, grids = [item] * n, [grid] * n
        pixels = torch.cat([image_patches(i, dims.patch_size, device) for i in items])
        ours_ms = _time(lambda: projector(tower(pixels.to(dtype), grids), grids), args.iters, device)
        thw = torch.tensor(grids, device=device)
        hf_ms = _time(lambda: hf_proj(hf_tower(pixels.to(dtype), grid_thw=thw).pooler_output), args.iters, device)
        print(f"{n} image(s): ours {ours_ms:.2f} ms, transformers {hf_ms:.2f} ms ({n * processed.num_tokens} tokens)")


if __name__ == "__main__":
    main()
