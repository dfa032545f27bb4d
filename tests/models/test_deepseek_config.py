"""What the DeepSeek model reads from the real configs: routing per family, the YaRN softmax
scale, the latent KV size per token, and clear errors for what it does not support."""
from __future__ import annotations

import copy

import pytest
import torch

from atom_core.loader.model_dir import resolve_model_files
from atom_core.model_ops.kv_spec import attention_layers
from atom_core.models.deepseek_v2 import deepseek_routing, mla_softmax_scale


def _config(name: str):
    return resolve_model_files(f"preset:{name}").hf_config


def test_routing_of_each_preset():
    v2 = deepseek_routing(_config("DeepSeek-V2-Lite"))
    assert (v2.scoring, v2.top_k, v2.renormalize, v2.correction_bias, v2.num_expert_group) == (
        "softmax", 6, False, False, None)
    v3 = deepseek_routing(_config("DeepSeek-V3"))
    assert (v3.scoring, v3.top_k, v3.renormalize, v3.correction_bias, v3.num_expert_group, v3.topk_group,
            v3.routed_scaling_factor) == ("sigmoid", 8, True, True, 8, 4, 2.5)
    kimi = deepseek_routing(_config("Kimi-K2"))
    assert (kimi.num_expert_group, kimi.topk_group, kimi.routed_scaling_factor) == (1, 1, 2.827)


def test_group_limited_greedy_and_unknown_methods():
    config = copy.deepcopy(_config("DeepSeek-V2-Lite"))
    config.topk_method, config.n_group, config.topk_group = "group_limited_greedy", 8, 3
    routing = deepseek_routing(config)
    assert (routing.scoring, routing.num_expert_group, routing.topk_group) == ("softmax", 8, 3)
    config.topk_method = "sinkhorn"
    with pytest.raises(ValueError, match="topk_method 'sinkhorn'.*greedy, group_limited_greedy"):
        deepseek_routing(config)


@pytest.mark.parametrize("name, mscale_all_dim", [("DeepSeek-V2-Lite", 0.707), ("DeepSeek-V3", 1.0)])
def test_softmax_scale_follows_yarn_mscale(name, mscale_all_dim):
    import math

    mscale = 0.1 * mscale_all_dim * math.log(40) + 1.0  # factor 40 in both configs
    assert mla_softmax_scale(_config(name)) == pytest.approx(192 ** -0.5 * mscale * mscale)


def test_v3_kv_cache_is_576_values_per_token_and_layer():
    from atom_core.models.registry import resolve_model_class

    config = _config("DeepSeek-V3")
    del config.quantization_config
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = resolve_model_class(config)(config)
    finally:
        torch.set_default_dtype(old)
    layers = attention_layers(model)
    assert len(layers) == 61 and {layer.kv_spec.kind for layer in layers} == {"mla"}
    assert sum(layer.kv_spec.bytes_per_token for layer in layers) == 61 * 576 * 2
    assert layers[0].num_heads == 128 and layers[0].v_head_dim == 128
