"""The quantization hook: config detection, and a layer whose parameters, post-load repacking
and product all come from its quant method (a test-only int8 method exercises every step)."""
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig

from atom_core.loader import build_model
from atom_core.quant import QuantConfig, QuantMethod, get_quant_config, set_weight_attrs, supported_quantizations
from tests.models.harness import prompt_logits


class TestQuantConfigDetection:
    def test_no_quantization_config_is_unquantized(self):
        assert get_quant_config(LlamaConfig()) is None

    def test_unsupported_method_names_it_and_the_supported_ones(self):
        config = LlamaConfig()
        config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
        with pytest.raises(ValueError, match=r"unsupported quantization 'bitsandbytes' \(config.json "
                                             r"quantization_config\); supported: .*compressed-tensors"):
            get_quant_config(config)

    def test_unsupported_override_is_refused(self):
        with pytest.raises(ValueError, match=r"unsupported quantization 'bitsandbytes' \(--quantization\)"):
            get_quant_config(LlamaConfig(), override="bitsandbytes")

    def test_registered_formats_are_listed(self):
        assert {"awq", "compressed-tensors", "gptq"} <= set(supported_quantizations())


class Int8PerChannel(QuantMethod):
    """int8 weight + fp32 per-output-channel scale, dequantized once after loading."""

    def create_weights(self, layer, *, input_size, output_sizes, weight_loader, params_dtype=None):
        qweight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=torch.int8), requires_grad=False)
        scale = nn.Parameter(torch.empty(sum(output_sizes), dtype=torch.float32), requires_grad=False)
        set_weight_attrs(qweight, weight_loader=weight_loader, output_dim=0, input_dim=1)
        set_weight_attrs(scale, weight_loader=weight_loader, output_dim=0)
        layer.register_parameter("weight", qweight)
        layer.register_parameter("weight_scale", scale)

    def process_weights_after_loading(self, layer):
        layer.dequantized = (layer.weight.float() * layer.weight_scale[:, None]).to(torch.get_default_dtype())
        layer.processed = True

    def apply(self, layer, x, bias=None):
        return F.linear(x, layer.dequantized, bias)


class Int8Config(QuantConfig):
    name = "test-int8"

    @classmethod
    def from_config(cls, quantization_config):
        return cls()

    def get_quant_method(self, layer, prefix):
        return Int8PerChannel() if prefix.endswith("_proj") else None


def test_quantized_layers_load_process_and_apply(tiny_llama, tmp_path):
    """int8 q/k/v and gate/up shards with their scales load by rule, keep their dtype, are
    processed once, and the model equals one built from the dequantized weights."""
    from safetensors import safe_open

    from transformers import AutoConfig

    tensors, dequantized = {}, {}
    with safe_open(str(tiny_llama / "model.safetensors"), "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            if name.endswith("_proj.weight"):
                scale = t.abs().amax(dim=1).clamp_min(1e-8) / 127
                q = torch.round(t / scale[:, None]).to(torch.int8)
                tensors[name], tensors[name + "_scale"] = q, scale.float()
                dequantized[name] = q.float() * scale[:, None]
            else:
                tensors[name] = dequantized[name] = t
    (tmp_path / "quant").mkdir()
    (tmp_path / "plain").mkdir()
    save_file(tensors, str(tmp_path / "quant" / "model.safetensors"))
    save_file(dequantized, str(tmp_path / "plain" / "model.safetensors"))
    config = AutoConfig.from_pretrained(str(tiny_llama))
    quant = build_model(config, tmp_path / "quant", torch.float32, "cpu", quant_config=Int8Config())
    plain = build_model(config, tmp_path / "plain", torch.float32, "cpu")
    qkv = quant.model.layers[1].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.int8 and qkv.weight_scale.dtype == torch.float32 and qkv.processed
    assert not hasattr(quant.lm_head, "quant_method")
    prompt = list(range(3, 40))
    torch.testing.assert_close(prompt_logits(quant, prompt), prompt_logits(plain, prompt), rtol=1e-5, atol=1e-5)
