"""HF architecture name -> its image processor adapter, imported lazily (as models/registry.py)."""
from __future__ import annotations

import importlib
import json
from pathlib import Path

_PROCESSORS = {
    "Qwen3_5ForConditionalGeneration": ("atom_core.multimodal.processors.qwen3_5", "Qwen3_5ImageProcessor"),
    "Qwen3_5MoeForConditionalGeneration": ("atom_core.multimodal.processors.qwen3_5", "Qwen3_5ImageProcessor"),
    "KimiK25ForConditionalGeneration": ("atom_core.multimodal.processors.kimi_k25", "KimiK25ImageProcessor"),
    "Kimi_K25ForConditionalGeneration": ("atom_core.multimodal.processors.kimi_k25", "KimiK25ImageProcessor"),
}


def takes_images(architecture: str) -> bool:
    return architecture in _PROCESSORS


def image_processor_class(architecture: str):
    """The adapter class for `architecture`; ValueError for a model that takes no images."""
    if architecture not in _PROCESSORS:
        raise ValueError(f"this model ({architecture}) takes no images; image input is served for: "
                         f"{', '.join(sorted(_PROCESSORS))}")
    module, name = _PROCESSORS[architecture]
    return getattr(importlib.import_module(module), name)


def build_image_processor(model_dir: Path | str, tokenizer):
    """The adapter of the model in `model_dir` (its config.json's architecture), or None for a model
    that takes no images. ValueError when its processor settings cannot be read. tokenizer None: for
    the adapter's settings only (the engine core sizes the encoder budget from max_tokens_per_image)."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    arch = next((a for a in config.get("architectures") or [] if a in _PROCESSORS), None)
    if arch is None:
        return None
    return image_processor_class(arch)(model_dir, config, tokenizer)
