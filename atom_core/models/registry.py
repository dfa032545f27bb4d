"""HF `architectures` name -> model class, imported lazily."""
from __future__ import annotations

import importlib

from torch import nn

_MODELS = {
    "LlamaForCausalLM": ("atom_core.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("atom_core.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("atom_core.models.qwen3", "Qwen3ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(config) -> type[nn.Module]:
    names = getattr(config, "architectures", None) or []
    for name in names:
        if name in _MODELS:
            module, cls = _MODELS[name]
            return getattr(importlib.import_module(module), cls)
    raise ValueError(
        f"unsupported model architecture {names or '(none in config.json)'}; "
        f"supported: {', '.join(supported_architectures())}"
    )
