"""PEFT adapter files: what is read, what is refused and why; the registry; LoRAConfig."""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from atom_core.config import EngineConfig
from atom_core.lora import LoRARegistry, LoRARequest, as_lora_request, check_adapter_shapes, load_adapter, parse_lora_modules
from tests.lora.adapters import make_adapter


def _edit(src, dst, config=None, tensors=None):
    """A copy of adapter `src` with adapter_config.json keys set and tensors changed (None: removed)."""
    shutil.copytree(src, dst)
    if config:
        data = json.loads((dst / "adapter_config.json").read_text()) | config
        (dst / "adapter_config.json").write_text(json.dumps(data))
    if tensors:
        weights = load_file(str(dst / "adapter_model.safetensors"))
        for key, value in tensors.items():
            if value is None:
                weights.pop(key)
            else:
                weights[key] = value
        save_file(weights, str(dst / "adapter_model.safetensors"))
    return dst


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


class TestLoadAdapter:
    def test_reads_rank_scaling_and_every_module(self, adapters):
        adapter = load_adapter(adapters["all8"], max_rank=16)
        assert adapter.rank == 8 and adapter.scaling == 16 / 8
        assert adapter.target_modules == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
        a, b = adapter.weights["model.layers.1.mlp.down_proj"]
        assert a.shape == (8, 128) and b.shape == (64, 8)

    def test_rslora_scales_by_alpha_over_sqrt_rank(self, adapters):
        assert load_adapter(adapters["attn4rs"], max_rank=16).scaling == pytest.approx(8 / math.sqrt(4))

    def test_refuses_a_rank_above_the_limit(self, adapters):
        with pytest.raises(ValueError, match="rank 16 is above --max-lora-rank 8"):
            load_adapter(adapters["mlp16"], max_rank=8)

    @pytest.mark.parametrize("config,match", [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "all"}, "bias='all' is not supported"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
        ({"peft_type": "IA3"}, "peft_type 'IA3'"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"r": 0}, "r=0 must be a positive integer"),
        ({"lora_alpha": -1}, "lora_alpha=-1"),
    ])
    def test_refuses_what_it_cannot_serve(self, adapters, tmp_path, config, match):
        with pytest.raises(ValueError, match=match):
            load_adapter(_edit(adapters["all8"], tmp_path / "bad", config), max_rank=16)

    def test_refuses_embedding_and_lm_head_adapters(self, adapters, tmp_path):
        key = "base_model.model.lm_head.lora_A.weight"
        with pytest.raises(ValueError, match="embedding / lm_head adapters are not supported"):
            load_adapter(_edit(adapters["all8"], tmp_path / "head", tensors={key: torch.zeros(8, 64)}), 16)
        key = "base_model.model.model.embed_tokens.lora_embedding_A"
        with pytest.raises(ValueError, match="embedding / lm_head adapters are not supported"):
            load_adapter(_edit(adapters["all8"], tmp_path / "emb", tensors={key: torch.zeros(8, 64)}), 16)

    def test_refuses_an_unknown_target_module(self, adapters, tmp_path):
        key = "base_model.model.model.layers.0.mlp.fc1.lora_A.weight"
        bad = _edit(adapters["all8"], tmp_path / "fc1", tensors={key: torch.zeros(8, 64),
                                                                 key.replace("lora_A", "lora_B"): torch.zeros(64, 8)})
        with pytest.raises(ValueError, match="target module 'fc1'.*expected some of: q_proj"):
            load_adapter(bad, 16)

    def test_refuses_a_dora_magnitude_and_a_half_pair(self, adapters, tmp_path):
        key = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"
        with pytest.raises(ValueError, match="not a LoRA A/B weight"):
            load_adapter(_edit(adapters["all8"], tmp_path / "mag", tensors={key: torch.zeros(64)}), 16)
        with pytest.raises(ValueError, match="lacks its lora_A weight"):
            load_adapter(_edit(adapters["all8"], tmp_path / "half", tensors={Q_A: None}), 16)

    def test_refuses_missing_files(self, adapters, tmp_path):
        with pytest.raises(ValueError, match="is not a directory"):
            load_adapter(tmp_path / "nowhere", 16)
        (tmp_path / "empty").mkdir()
        with pytest.raises(ValueError, match="no adapter_config.json"):
            load_adapter(tmp_path / "empty", 16)
        bad = _edit(adapters["all8"], tmp_path / "nosafe")
        (bad / "adapter_model.safetensors").unlink()
        with pytest.raises(ValueError, match="no adapter_model.safetensors"):
            load_adapter(bad, 16)


class TestCheckShapes:
    def test_accepts_the_base_models_adapter(self, adapters, lora_base):
        from transformers import AutoConfig

        check_adapter_shapes(load_adapter(adapters["all8"], 16), AutoConfig.from_pretrained(lora_base))

    def test_refuses_an_adapter_of_another_model(self, adapters, lora_base):
        from transformers import AutoConfig

        other = AutoConfig.from_pretrained(lora_base)
        other.intermediate_size = 96
        with pytest.raises(ValueError, match="down_proj.* maps 128 -> 64 features; the base model.s maps 96 -> 64"):
            check_adapter_shapes(load_adapter(adapters["all8"], 16), other)
        other = AutoConfig.from_pretrained(lora_base)
        other.num_hidden_layers = 1
        with pytest.raises(ValueError, match="past the base model's 1 layers"):
            check_adapter_shapes(load_adapter(adapters["all8"], 16), other)


class TestRegistry:
    def _registry(self, lora_base):
        from transformers import AutoConfig

        return LoRARegistry(16, AutoConfig.from_pretrained(lora_base), reserved=("base",))

    def test_adds_with_fresh_ids_and_removes(self, adapters, lora_base):
        registry = self._registry(lora_base)
        first = registry.add("a", str(adapters["all8"]))
        registry.remove("a")
        again = registry.add("a", str(adapters["all8"]))
        assert again.lora_int_id != first.lora_int_id  # never reused: the prefix cache keys by id
        with pytest.raises(ValueError, match="already loaded"):
            registry.add("a", str(adapters["mlp16"]))
        with pytest.raises(ValueError, match="the base model's name"):
            registry.add("base", str(adapters["mlp16"]))
        with pytest.raises(KeyError, match="no LoRA adapter named 'zzz'"):
            registry.remove("zzz")

    def test_as_lora_request_takes_names_and_request_objects(self, adapters, lora_base):
        registry = self._registry(lora_base)
        made = as_lora_request(LoRARequest("x", 0, str(adapters["all8"])), registry)
        assert as_lora_request("x", registry) == made
        with pytest.raises(ValueError, match="unknown LoRA adapter 'y'"):
            as_lora_request("y", registry)
        with pytest.raises(ValueError, match="is loaded from"):
            as_lora_request(LoRARequest("x", 0, str(adapters["mlp16"])), registry)
        with pytest.raises(ValueError, match="expected an adapter name"):
            as_lora_request(3, registry)
        with pytest.raises(ValueError, match="enable_lora=True"):
            as_lora_request("x", None)


class TestConfig:
    def test_parses_modules(self):
        assert parse_lora_modules(["a=/x", " b = /y "]) == [("a", "/x", None), ("b", "/y", None)]
        with pytest.raises(ValueError, match="expected NAME=PATH"):
            parse_lora_modules(["a"])
        with pytest.raises(ValueError, match="names 'a' twice"):
            parse_lora_modules(["a=/x", "a=/y"])

    @pytest.mark.parametrize("options,match", [
        ({"max_loras": 2}, "max_loras=2 .*needs --enable-lora"),
        ({"lora_modules": ["a=/x"]}, "needs --enable-lora"),
        ({"max_lora_rank": 8}, "needs --enable-lora"),
        ({"max_cpu_loras": 3}, "needs --enable-lora"),
        ({"enable_lora": True, "max_loras": 0}, "must be >= 1"),
        ({"enable_lora": True, "max_lora_rank": 0}, "must be >= 1"),
        ({"enable_lora": True, "max_loras": 2, "max_cpu_loras": 1}, "must be >= max_loras=2"),
        ({"enable_lora": True, "lora_modules": ["nopath"]}, "expected NAME=PATH"),
    ])
    def test_refuses_bad_options(self, options, match):
        with pytest.raises(ValueError, match=match):
            EngineConfig.from_kwargs("m", **options)

    def test_cpu_cache_defaults_to_max_loras(self):
        lora = EngineConfig.from_kwargs("m", enable_lora=True, max_loras=3).lora
        assert lora.cpu_cache_size == 3 and lora.modules == []
