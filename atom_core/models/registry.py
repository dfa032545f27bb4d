"""HF `architectures` name -> model class, imported lazily."""
from __future__ import annotations

import importlib

from torch import nn

_MODELS = {
    "LlamaForCausalLM": ("atom_core.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("atom_core.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("atom_core.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("atom_core.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("atom_core.models.mixtral", "MixtralForCausalLM"),
    "Glm4MoeForCausalLM": ("atom_core.models.glm4_moe", "Glm4MoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("atom_core.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("atom_core.models.deepseek_v2", "DeepseekV3ForCausalLM"),
    "DeepseekV32ForCausalLM": ("atom_core.models.deepseek_v32", "DeepseekV32ForCausalLM"),
    "GlmMoeDsaForCausalLM": ("atom_core.models.deepseek_v32", "GlmMoeDsaForCausalLM"),
    "GptOssForCausalLM": ("atom_core.models.gpt_oss", "GptOssForCausalLM"),
    "Qwen3NextForCausalLM": ("atom_core.models.qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5ForCausalLM": ("atom_core.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("atom_core.models.qwen3_5", "Qwen3_5MoeForCausalLM"),
    "Qwen3_5ForConditionalGeneration": ("atom_core.models.qwen3_5", "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForConditionalGeneration": ("atom_core.models.qwen3_5", "Qwen3_5MoeForConditionalGeneration"),
    # The published config's name, and transformers' class name for the same model
    "KimiK25ForConditionalGeneration": ("atom_core.models.kimi_k25", "KimiK25ForConditionalGeneration"),
    "Kimi_K25ForConditionalGeneration": ("atom_core.models.kimi_k25", "KimiK25ForConditionalGeneration"),
}

# Vision-language architectures whose config's `text_config` is the model's config, with the vision
# config attached (loader/model_dir.py resolves it).
_TEXT_OF_MULTIMODAL = frozenset({"Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
                                 "KimiK25ForConditionalGeneration", "Kimi_K25ForConditionalGeneration"})


# Architectures whose checkpoints may carry a trust_remote_code config (their own model_type)
# that transformers' native config class reads as well: Kimi-K2 ("kimi_k2") is a DeepSeek-V3.
_NATIVE_MODEL_TYPES = {"DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3"}


def native_model_type(architecture: str) -> str | None:
    return _NATIVE_MODEL_TYPES.get(architecture)


def serves_text_config(architecture: str) -> bool:
    return architecture in _TEXT_OF_MULTIMODAL


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def check_architectures(names: list[str] | None) -> str:
    """The first supported name in a config's `architectures`; ValueError listing ours otherwise."""
    for name in names or []:
        if name in _MODELS:
            return name
    raise ValueError(
        f"unsupported model architecture {names or '(none in config.json)'}; "
        f"supported: {', '.join(supported_architectures())}"
    )


def model_takes_images(config) -> bool:
    """Whether the config's model class is a vision-language model (models/common.py: supports_images)."""
    return bool(getattr(resolve_model_class(config), "supports_images", False))


def resolve_model_class(config) -> type[nn.Module]:
    module, cls = _MODELS[check_architectures(getattr(config, "architectures", None))]
    return getattr(importlib.import_module(module), cls)
