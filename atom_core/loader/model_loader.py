"""One entry point from an HF config to a ready model: build, fill, post-process, eval."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from torch import nn

from atom_core.loader.weights import init_dummy_weights, load_weights
from atom_core.models.registry import resolve_model_class
from atom_core.quant import QuantConfig


def process_weights_after_loading(model: nn.Module) -> None:
    """Let every layer's quant method repack what the loader filled (once, after loading)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)


def build_model(hf_config, model_path: Path | str | None, dtype: torch.dtype, device: torch.device | str,
                load_format: Literal["auto", "dummy"] = "auto", seed: int = 0,
                quant_config: QuantConfig | None = None) -> nn.Module:
    """The model of `hf_config`'s architecture, its parameters created in `dtype` on `device`
    (parameters a quant method makes in other dtypes keep theirs), filled from the
    safetensors in `model_path` or, with load_format "dummy", with small random values
    seeded by `seed`; then post-processed for the kernels and put in eval mode."""
    model_cls = resolve_model_class(hf_config)
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls(hf_config, quant_config=quant_config)
    finally:
        torch.set_default_dtype(old_dtype)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        if model_path is None:
            raise ValueError("a model path is needed unless load_format is 'dummy'")
        load_weights(model, Path(model_path))
    process_weights_after_loading(model)
    return model.eval()
