"""DeepSeek presets read with their real configs (Kimi-K2's trust_remote_code config through
the native DeepSeek-V3 class, no prompt), their parameter counts, and the start-time memory
guard: a model whose weights cannot fit is refused with what it needs, what the GPU has, and
which options help."""
from __future__ import annotations

import pytest
import torch

from atom_core.loader.model_dir import resolve_model_files
from atom_core.worker.memory import check_weights_fit, model_weight_bytes

GIB = 1 << 30


def _bf16_config(name: str):
    config = resolve_model_files(f"preset:{name}").hf_config
    if hasattr(config, "quantization_config"):  # the bf16 model: what a non-quantized start would load
        del config.quantization_config
    return config


@pytest.mark.parametrize("name, billions", [("DeepSeek-V2-Lite", 15.7), ("DeepSeek-V3", 671.2), ("Kimi-K2", 1026.6)])
def test_presets_have_the_published_parameter_counts(name, billions):
    config = _bf16_config(name)
    assert type(config).__name__ in ("DeepseekV2Config", "DeepseekV3Config")
    params = model_weight_bytes(config, torch.bfloat16) / 2
    assert params / 1e9 == pytest.approx(billions, rel=2e-3)


def test_kimi_k2_reads_as_deepseek_v3_with_its_own_values():
    config = resolve_model_files("preset:Kimi-K2").hf_config
    assert type(config).__name__ == "DeepseekV3Config"
    assert (config.n_routed_experts, config.num_attention_heads, config.routed_scaling_factor) == (384, 64, 2.827)


def test_v3_in_bf16_is_refused_on_an_80_gib_gpu_with_a_clear_message():
    needed = model_weight_bytes(_bf16_config("DeepSeek-V3"), torch.bfloat16)
    with pytest.raises(ValueError) as info:
        check_weights_fit(needed, total_bytes=80 * GIB, utilization=0.9)
    message = str(info.value)
    assert "1250.1 GiB" in message and "80.0 GiB" in message and "72.0 GiB" in message
    assert "--tensor-parallel-size 32" in message and "quantized checkpoint" in message


def test_a_quantized_model_is_not_told_to_quantize():
    with pytest.raises(ValueError) as info:
        check_weights_fit(700 * GIB, total_bytes=140 * GIB, utilization=0.9, tp_size=8, quantized=True)
    assert "quantized" not in str(info.value) and "--tensor-parallel-size 8" not in str(info.value)


def test_utilization_is_suggested_when_it_alone_would_help():
    with pytest.raises(ValueError, match="--gpu-memory-utilization 0.80"):
        check_weights_fit(60 * GIB, total_bytes=80 * GIB, utilization=0.5)


def test_v2_lite_fits_an_80_gib_gpu():
    check_weights_fit(model_weight_bytes(_bf16_config("DeepSeek-V2-Lite"), torch.bfloat16), 80 * GIB, 0.9)
