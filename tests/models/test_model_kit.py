"""What the model files declare: per-layer KV specs and windows from each family's fields,
every linear's full prefix, the bias and rotary choices, and the registry."""
import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen3Config

from atom_core.model_ops.kv_spec import KVSpec, attention_layers
from atom_core.model_ops.linear import LinearBase
from atom_core.models.registry import resolve_model_class

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)


def build(config):
    return resolve_model_class(config)(config)


class TestKVSpecsFromConfigs:
    def test_llama_layers_have_full_attention(self):
        model = build(LlamaConfig(**SMALL, architectures=["LlamaForCausalLM"]))
        assert [layer.kv_spec for layer in attention_layers(model)] == [KVSpec("mha", 2, 8, torch.float32)] * 4

    def test_mistral_window_applies_to_every_layer(self):
        model = build(MistralConfig(**SMALL, sliding_window=16, architectures=["MistralForCausalLM"]))
        assert [layer.kv_spec.sliding_window for layer in attention_layers(model)] == [16] * 4

    def test_qwen3_window_follows_layer_types(self):
        config = Qwen3Config(**SMALL, use_sliding_window=True, sliding_window=16, max_window_layers=2,
                             architectures=["Qwen3ForCausalLM"])
        model = build(config)
        assert [layer.kv_spec.sliding_window for layer in attention_layers(model)] == [None, None, 16, 16]

    def test_qwen3_window_is_off_without_use_sliding_window(self):
        model = build(Qwen3Config(**SMALL, sliding_window=16, architectures=["Qwen3ForCausalLM"]))
        assert all(layer.kv_spec.sliding_window is None for layer in attention_layers(model))

    def test_mqa_head_layout(self):
        config = LlamaConfig(**{**SMALL, "num_key_value_heads": 1}, head_dim=16, architectures=["LlamaForCausalLM"])
        model = build(config)
        assert attention_layers(model)[0].kv_spec == KVSpec("mha", 1, 16, torch.float32)


class TestModelKit:
    def test_every_linear_knows_its_full_prefix(self):
        model = build(Qwen3Config(**SMALL, architectures=["Qwen3ForCausalLM"]))
        prefixes = {name: m.prefix for name, m in model.named_modules() if isinstance(m, LinearBase)}
        assert prefixes and all(name == prefix for name, prefix in prefixes.items())
        assert "model.layers.3.self_attn.qkv_proj" in prefixes and "model.layers.0.mlp.down_proj" in prefixes

    def test_attention_bias_sets_qkv_and_o_proj_bias(self):
        model = build(LlamaConfig(**SMALL, attention_bias=True, architectures=["LlamaForCausalLM"]))
        attn = model.model.layers[0].self_attn
        assert attn.qkv_proj.bias is not None and attn.o_proj.bias is not None

    def test_qwen3_norms_feed_the_attention_layer(self):
        model = build(Qwen3Config(**SMALL, architectures=["Qwen3ForCausalLM"]))
        block = model.model.layers[0].self_attn
        assert block.attn.qk.q_norm is block.q_norm and block.attn.qk.rotary is block.rotary_emb
        names = {n for n, _ in model.named_parameters()}
        assert "model.layers.0.self_attn.q_norm.weight" in names
        # norms keep their checkpoint names only; the attention layer holds just its KV-cache scales
        assert {n.rsplit(".", 1)[1] for n in names if ".attn." in n} == {"k_scale", "v_scale"}

    def test_unsupported_activation_fails_at_construction(self):
        with pytest.raises(ValueError, match="unsupported hidden_act 'gelu'; expected silu"):
            build(LlamaConfig(**SMALL, hidden_act="gelu", architectures=["LlamaForCausalLM"]))

    def test_unknown_architecture_lists_the_supported_ones(self):
        with pytest.raises(ValueError, match="unsupported model architecture.*LlamaForCausalLM"):
            resolve_model_class(LlamaConfig(**SMALL, architectures=["GPT2LMHeadModel"]))


@pytest.mark.parametrize("preset,billions", [("Qwen3-30B-A3B", 30.53), ("Qwen3-235B-A22B", 235.09),
                                             ("Mixtral-8x7B", 46.70), ("GLM-4.5-Air", 106.85)])
def test_moe_presets_build_with_their_published_sizes(preset, billions):
    """Real configs for dummy-weight runs: built on the meta device, the parameter count is the
    model card's total (GLM-4.5-Air's 106B excludes its MTP layer, as we do)."""
    from atom_core.loader.model_dir import resolve_model_files

    config = resolve_model_files(f"preset:{preset}").hf_config
    with torch.device("meta"):
        model = build(config)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == billions
