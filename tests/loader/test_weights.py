"""The loader: names mapped by whole components and declared rules, dtype left to each
parameter's loader, dummy weights for every parameter, build_model end to end."""
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import AutoConfig

from atom_core.loader import build_model, init_dummy_weights, load_weights
from atom_core.loader.weights import NameMapper
from atom_core.model_ops.linear import MergedColumnParallelLinear


class ToyExperts(nn.Module):
    """Stacked gate/up of 8 experts; records what the loader routed to it."""

    def __init__(self):
        super().__init__()
        self.w13_weight = nn.Parameter(torch.zeros(8, 4, 2), requires_grad=False)
        self.w13_weight.weight_loader = self.weight_loader
        self.calls = []

    def weight_loader(self, param, loaded, shard_id, expert_id):
        self.calls.append((shard_id, expert_id))
        rows = slice(0, 2) if shard_id == "w1" else slice(2, 4)
        param.data[expert_id, rows] = loaded


class ToyModel(nn.Module):
    """model.layers.0.mlp: a dense gate_up_proj, and (optionally) stacked experts."""

    stacked_params_mapping = [("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]

    def __init__(self, with_experts: bool):
        super().__init__()
        self.config = SimpleNamespace(tie_word_embeddings=False)
        mlp = nn.Module()
        mlp.gate_up_proj = MergedColumnParallelLinear(2, [2, 2])
        if with_experts:
            mlp.experts = ToyExperts()
            self.expert_params_mapping = [
                ("experts.w13_weight", f"experts.{e}.{name}.weight", e, shard)
                for e in range(8) for name, shard in (("gate_proj", "w1"), ("up_proj", "w3"))
            ]
        layer = nn.Module()
        layer.mlp = mlp
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([layer])


def save(path, tensors):
    path.mkdir(exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    return path


class TestNameMapping:
    def test_stacked_rule_matches_the_module_component(self):
        model = ToyModel(with_experts=False)
        mapper = NameMapper(model, dict(model.named_parameters()))
        assert mapper.map("model.layers.0.mlp.up_proj.weight") == ("model.layers.0.mlp.gate_up_proj.weight",
                                                                   {"shard_id": 1})

    def test_substring_of_a_component_is_not_a_match(self):
        model = ToyModel(with_experts=False)
        mapper = NameMapper(model, dict(model.named_parameters()))
        assert mapper.map("model.layers.0.mlp.shared_gate_proj.weight") is None
        assert mapper.map("model.layers.0.mlp.gate_proj_x.weight") is None

    def test_expert_tensor_is_unexpected_without_an_experts_param(self, tmp_path):
        """The dense gate_proj rule must not claim `experts.7.gate_proj`: no such param, so it is an error."""
        model = ToyModel(with_experts=False)
        path = save(tmp_path / "ckpt", {"model.layers.0.mlp.gate_proj.weight": torch.ones(2, 2),
                                        "model.layers.0.mlp.up_proj.weight": torch.ones(2, 2),
                                        "model.layers.0.mlp.experts.7.gate_proj.weight": torch.ones(2, 2)})
        with pytest.raises(ValueError, match=r"'model.layers.0.mlp.experts.7.gate_proj.weight' has no matching"):
            load_weights(model, path)

    def test_expert_tensor_goes_to_the_experts_param(self, tmp_path):
        model = ToyModel(with_experts=True)
        tensors = {"model.layers.0.mlp.gate_proj.weight": torch.full((2, 2), 1.0),
                   "model.layers.0.mlp.up_proj.weight": torch.full((2, 2), 2.0)}
        for e in range(8):
            tensors[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] = torch.full((2, 2), 10.0 + e)
            tensors[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] = torch.full((2, 2), 20.0 + e)
        load_weights(model, save(tmp_path / "ckpt", tensors))
        mlp = model.model.layers[0].mlp
        assert mlp.gate_up_proj.weight.tolist() == [[1.0, 1.0]] * 2 + [[2.0, 2.0]] * 2
        assert sorted(mlp.experts.calls) == sorted((s, e) for e in range(8) for s in ("w1", "w3"))
        assert mlp.experts.w13_weight[7, :, 0].tolist() == [17.0, 17.0, 27.0, 27.0]


class DtypeModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(tie_word_embeddings=False)
        self.packed = nn.Parameter(torch.zeros(4, dtype=torch.int32), requires_grad=False)
        self.fp8 = nn.Parameter(torch.zeros(4, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.scale = nn.Parameter(torch.zeros(2, dtype=torch.float32), requires_grad=False)


class TestDtypes:
    def test_non_float_params_keep_their_dtype_and_bits(self, tmp_path):
        packed = torch.tensor([-(2**31), -1, 0x12345678, 2**31 - 1], dtype=torch.int32)
        fp8 = torch.tensor([0.5, -1.0, 448.0, 0.0]).to(torch.float8_e4m3fn)
        model = DtypeModel()
        load_weights(model, save(tmp_path / "ckpt", {"packed": packed, "fp8": fp8,
                                                     "scale": torch.tensor([0.25, 3.0], dtype=torch.bfloat16)}))
        assert model.packed.dtype == torch.int32 and torch.equal(model.packed, packed)
        assert model.fp8.dtype == torch.float8_e4m3fn
        assert torch.equal(model.fp8.view(torch.uint8), fp8.view(torch.uint8))
        assert model.scale.dtype == torch.float32 and model.scale.tolist() == [0.25, 3.0]

    def test_wrong_dtype_for_an_integer_param_is_a_clear_error(self, tmp_path):
        path = save(tmp_path / "ckpt", {"packed": torch.zeros(4, dtype=torch.int64),
                                        "fp8": torch.zeros(4, dtype=torch.float8_e4m3fn), "scale": torch.zeros(2)})
        with pytest.raises(ValueError, match="dtype torch.int64 cannot load into a torch.int32 parameter"):
            load_weights(DtypeModel(), path)

    def test_dummy_fills_every_param_in_its_dtype(self):
        model = DtypeModel()
        init_dummy_weights(model, seed=3)
        assert model.packed.dtype == torch.int32 and model.packed.ne(0).all()
        assert model.fp8.dtype == torch.float8_e4m3fn and model.fp8.float().abs().max() <= 1e-3
        assert model.scale.ne(0).all() and model.scale.abs().max() <= 1e-3


class TestRealModels:
    def test_dummy_values_follow_todays_generator_order(self, tiny_qwen3):
        """One generator per device, parameters in named_parameters() order, norms 1 +- scale:
        the values dense benchmarks ran with before the loader rework."""
        config = AutoConfig.from_pretrained(str(tiny_qwen3))
        model = build_model(config, None, torch.float32, "cpu", load_format="dummy", seed=5)
        gen = torch.Generator().manual_seed(5)
        for name, param in model.named_parameters():
            if getattr(param, "optional_in_checkpoint", False):  # KV-cache scales keep 1.0, draw nothing
                assert name.endswith(("k_scale", "v_scale")) and torch.equal(param, torch.ones_like(param)), name
                continue
            low, high = (1 - 1e-3, 1 + 1e-3) if "norm" in name else (-1e-3, 1e-3)
            assert torch.equal(param, torch.empty_like(param).uniform_(low, high, generator=gen)), name

    def test_tied_checkpoint_loads_and_shares_the_embedding(self, tiny_qwen3):
        config = AutoConfig.from_pretrained(str(tiny_qwen3))
        model = build_model(config, tiny_qwen3, torch.float32, "cpu")
        assert model.lm_head.weight is model.model.embed_tokens.weight and not model.training
        with safe_open(str(tiny_qwen3 / "model.safetensors"), "pt") as f:
            q = f.get_tensor("model.layers.1.self_attn.q_proj.weight")
            assert torch.equal(model.model.layers[1].self_attn.qkv_proj.weight[: q.shape[0]], q)

    def test_bf16_checkpoint_converts_into_an_fp32_model(self, tiny_llama, tmp_path):
        with safe_open(str(tiny_llama / "model.safetensors"), "pt") as f:
            tensors = {k: f.get_tensor(k).to(torch.bfloat16) for k in f.keys()}
        path = save(tmp_path / "bf16", tensors)
        model = build_model(AutoConfig.from_pretrained(str(tiny_llama)), path, torch.float32, "cpu")
        assert model.model.norm.weight.dtype == torch.float32
        assert torch.equal(model.model.norm.weight, tensors["model.norm.weight"].float())

    def test_missing_tensor_is_named(self, tiny_llama, tmp_path):
        with safe_open(str(tiny_llama / "model.safetensors"), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys() if k != "model.layers.1.self_attn.k_proj.weight"}
        path = save(tmp_path / "partial", tensors)
        with pytest.raises(ValueError, match=r"lacks weights for: model.layers.1.self_attn.qkv_proj.weight \(shards k"):
            build_model(AutoConfig.from_pretrained(str(tiny_llama)), path, torch.float32, "cpu")

    def test_no_weights_points_to_dummy(self, tiny_llama, tmp_path):
        with pytest.raises(ValueError, match="no \\*.safetensors weights.*load_format='dummy'"):
            build_model(AutoConfig.from_pretrained(str(tiny_llama)), tmp_path, torch.float32, "cpu")
