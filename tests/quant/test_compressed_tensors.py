"""compressed-tensors checkpoints written by llm-compressor (`oneshot` + `QuantizationModifier`)
on tiny Llama and Qwen3 models, loaded by our engine and compared with HF transformers loading
the same files.

W4A16: tokens must equal HF's exactly. Both sides dequantize the same integers with the same
scales in float32 and multiply in float32; nothing downstream is discontinuous.

W8A8: both sides quantize activations per token by compressed-tensors' rule (absmax / 127.5,
round half to even, clamp), but we accumulate int8 products exactly in int32 while HF multiplies
the dequantized values in float32. The ~1e-7 relative difference can move an activation across
a rounding boundary in a later layer, which shifts a logit by up to about one quantum's effect.
FP8 (FP8_DYNAMIC, static FP8) is the same situation: both sides quantize activations to e4m3 by
the same rule and multiply in float32, in a different order. Same check, same bound.

So the check is: teacher-forced over HF's own continuation, our logits are within EPS of HF's
at every step (this bounds the whole effect), and our greedy tokens equal HF's at least up to
the first step where HF's top-2 logit margin is below 2 * EPS (before it, a margin above 2 * EPS
and an error below EPS leave the same argmax, by induction over the steps).
"""
import json

import pytest
import torch

from atom_core import LLMEngine, SamplingParams
from tests.quant.llmcompressor_checkpoints import MAX_TOKENS, SCHEMES, make_checkpoints, prompts

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = tmp_path_factory.mktemp("llmcompressor")
    reference = make_checkpoints(out, list(SCHEMES))
    return out, reference


def _tokens(engine, vocab):
    return [o["token_ids"] for o in engine.generate(prompts(vocab), GREEDY)]


EPS = 0.1  # max |our logit - HF logit| allowed for W8A8 and FP8 (measured up to 0.05 on these models, logits of size 1-3)
# With an FP8 KV cache a ~1e-7 difference in K or V can flip a cache value one e4m3 step (2^-3
# relative, vs 2^-7 for an int8 activation): measured up to 0.21 on llama-fp8-kv, the first rows exact.
EPS_KV = 0.4
W4A16 = [n for n in SCHEMES if "w4a16" in n]
W8A8 = [n for n in SCHEMES if "w8a8" in n or "fp8" in n]  # activations quantized too: a logit bound


CHUNKED = {"llama-w8a8", "llama-w4a16-g64-asym", "qwen3-fp8-static"}  # also run with chunked prefill and max_num_seqs=2


def _engines(path):
    kv = {"kv_cache_dtype": "fp8"} if path.name.endswith("-kv") else {}  # the checkpoint's KV scales in use
    engines = [LLMEngine(str(path), **kv)]
    if path.name in CHUNKED:
        engines.append(LLMEngine(str(path), max_num_batched_tokens=16, max_num_seqs=2, **kv))
    return engines


@pytest.mark.parametrize("name", W4A16)
def test_w4a16_matches_hf_token_for_token(checkpoints, name):
    out, reference = checkpoints
    path = out / name
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    for engine in _engines(path):
        assert _tokens(engine, vocab) == reference[name]


@pytest.mark.parametrize("name", W8A8)
def test_activation_quantized_matches_hf_within_logit_bound(checkpoints, name):
    from transformers import AutoConfig

    from atom_core.loader import build_model
    from atom_core.quant import get_quant_config
    from tests.models.harness import prompt_logits

    out, reference = checkpoints
    path = out / name
    hf_logits = json.loads((out / "reference_logits.json").read_text())[name]
    cfg = AutoConfig.from_pretrained(str(path))
    model = build_model(cfg, path, torch.float32, "cpu", quant_config=get_quant_config(cfg))
    if name.endswith("-kv"):  # HF quantizes the KV cache with the checkpoint's scales: so do we
        from atom_core.model_ops.kv_spec import attention_layers, finalize_kv_scales, set_kv_cache_dtype

        set_kv_cache_dtype(attention_layers(model), torch.float8_e4m3fn)
        finalize_kv_scales(attention_layers(model))
    plist = prompts(cfg.vocab_size)
    eps = EPS_KV if name.endswith("-kv") else EPS
    for prompt, tokens, ref in zip(plist, reference[name], hf_logits):
        ours = prompt_logits(model, prompt + tokens[:-1])[len(prompt) - 1:]
        assert (ours - torch.tensor(ref)).abs().max() < eps
    for engine in _engines(path):
        for got, tokens, ref in zip(_tokens(engine, cfg.vocab_size), reference[name], hf_logits):
            top2 = torch.tensor(ref).topk(2, dim=-1).values
            close = ((top2[:, 0] - top2[:, 1]) < 2 * eps).nonzero()
            safe = int(close[0]) + 1 if len(close) else len(tokens)  # steps certain to agree
            assert got[:safe] == tokens[:safe]


def test_layers_get_the_checkpoint_scheme(checkpoints):
    from transformers import AutoConfig

    from atom_core.loader import build_model
    from atom_core.quant import get_quant_config
    from atom_core.quant.int4 import CompressedTensorsW4A16Method
    from atom_core.quant.fp8 import Fp8ScaledLinearMethod
    from atom_core.quant.int8 import Int8W8A8LinearMethod

    out, _ = checkpoints
    for name, method_cls in [("llama-w8a8", Int8W8A8LinearMethod), ("llama-w4a16-g64-asym", CompressedTensorsW4A16Method),
                             ("llama-fp8-dynamic", Fp8ScaledLinearMethod), ("qwen3-fp8-static", Fp8ScaledLinearMethod)]:
        cfg = AutoConfig.from_pretrained(str(out / name))
        model = build_model(cfg, out / name, torch.float32, "cpu", quant_config=get_quant_config(cfg))
        layer = model.model.layers[0]
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(linear.quant_method, method_cls)
        assert type(model.lm_head).__name__ and not hasattr(model.lm_head, "weight_scale")  # lm_head is ignored
        if name == "llama-w4a16-g64-asym":
            asym = model.model.layers[0].mlp.down_proj
            assert asym.w4_qweight.dtype == torch.int32 and asym.w4_zeros.dtype == torch.uint8
            assert asym.w4_group_size == 64 and not hasattr(asym, "weight_packed")  # repacked after loading
        if name == "qwen3-fp8-static":  # per-tensor scales repeated over each fused shard's rows
            from safetensors.torch import load_file

            ckpt = load_file(str(out / name / "model.safetensors"))
            qkv = layer.self_attn.qkv_proj
            rows = dict(zip("qkv", qkv.output_sizes))
            start = 0
            for shard in "qkv":
                want = ckpt[f"model.layers.0.self_attn.{shard}_proj.weight_scale"].float()
                assert torch.equal(qkv.weight_scale[start:start + rows[shard]], want.expand(rows[shard], 1))
                start += rows[shard]
            assert torch.equal(qkv.input_scale, ckpt["model.layers.0.self_attn.q_proj.input_scale"].float())
            assert not hasattr(model.model.layers[0].mlp.down_proj, "weight_zero_point")


def _ct_config(**group) -> dict:
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
    g = {"targets": ["Linear"], "weights": weights, "format": "pack-quantized", **group}
    return {"quant_method": "compressed-tensors", "config_groups": {"group_0": g}, "ignore": ["lm_head"],
            "quantization_status": "compressed"}


class TestConfigErrors:
    def _get(self, qc):
        from types import SimpleNamespace

        from atom_core.quant import get_quant_config
        return get_quant_config(SimpleNamespace(quantization_config=qc))

    def test_supported_config_parses(self):
        assert self._get(_ct_config()).schemes[0].format == "pack-quantized"
        fp8 = {"format": "float-quantized", "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
               "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}
        method = self._get(_ct_config(**fp8)).schemes[0].make_method()
        assert method.per_tensor_weight and method.static_input

    @pytest.mark.parametrize("group, message", [
        ({"format": "naive-quantized"}, "unsupported format"),
        ({"weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}, "expected int4"),
        ({"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "actorder": "group"}},
         "actorder"),
        ({"format": "int-quantized", "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
          "input_activations": {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False}},
         "expected int8 token"),
        ({"output_activations": {"num_bits": 8}}, "output activation"),
        ({"format": "float-quantized", "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}},
         "input activations none"),  # FP8 weight-only
        ({"format": "float-quantized", "weights": {"num_bits": 8, "type": "float", "strategy": "block"},
          "input_activations": {"num_bits": 8, "type": "float", "strategy": "group", "dynamic": True}},
         "expected float8 tensor or channel"),
        ({"format": "float-quantized", "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
          "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": False}},
         "expected float8 token dynamic"),
    ])
    def test_unsupported_scheme_names_it(self, group, message):
        with pytest.raises(ValueError, match=message):
            self._get(_ct_config(**group))

    def test_sparsity_and_kv_schemes_rejected(self):
        with pytest.raises(ValueError, match="sparsity_config"):
            self._get({**_ct_config(), "sparsity_config": {"format": "sparse-24"}})
        with pytest.raises(ValueError, match="kv_cache_scheme"):
            self._get({**_ct_config(), "kv_cache_scheme": {"num_bits": 8}})

    def test_quantized_lm_head_rejected(self):
        with pytest.raises(ValueError, match="lm_head"):
            self._get({**_ct_config(), "ignore": []})

    def test_unknown_quant_method_lists_supported(self):
        with pytest.raises(ValueError, match=r"unsupported quantization 'bitsandbytes'.*compressed-tensors"):
            self._get({"quant_method": "bitsandbytes"})


def test_target_and_ignore_matching():
    from atom_core.quant.compressed_tensors import CompressedTensorsConfig

    qc = _ct_config()
    qc["config_groups"]["group_0"]["targets"] = ["re:.*mlp\\..*"]
    qc["ignore"] = ["model.layers.1.mlp.down_proj"]
    cfg = CompressedTensorsConfig.from_config(qc)
    assert cfg._scheme_of("model.layers.0.mlp.down_proj") is not None
    assert cfg._scheme_of("model.layers.1.mlp.down_proj") is None
    assert cfg._scheme_of("model.layers.0.self_attn.q_proj") is None


@pytest.mark.parametrize("preset", ["Llama-3-8B-W4A16", "Llama-3-8B-W8A8"])
def test_quantized_presets_build_with_dummy_weights(preset):
    """preset:Llama-3-8B-W4A16 / -W8A8 (the benchmarks' configs: Llama-3-8B + llm-compressor's
    quantization_config) at toy sizes: every linear gets the scheme's method, dummy weights fill
    the quantized tensors, and the model runs."""
    from atom_core.loader import build_model
    from atom_core.loader.model_dir import resolve_model_files
    from atom_core.quant import get_quant_config
    from atom_core.quant.int4 import CompressedTensorsW4A16Method
    from atom_core.quant.int8 import Int8W8A8LinearMethod
    from tests.models.harness import greedy_generate

    cfg = resolve_model_files(f"preset:{preset}").hf_config
    qc = get_quant_config(cfg)
    assert qc.ignore == ["lm_head"]
    for key, value in dict(hidden_size=256, intermediate_size=512, num_hidden_layers=1, vocab_size=300,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64).items():
        setattr(cfg, key, value)
    model = build_model(cfg, None, torch.float32, "cpu", load_format="dummy", quant_config=qc)
    down = model.model.layers[0].mlp.down_proj
    if preset.endswith("W4A16"):
        assert qc.schemes[0].weights.group_size == 128
        assert isinstance(down.quant_method, CompressedTensorsW4A16Method) and down.w4_scales.shape == (256, 4)
    else:
        assert isinstance(down.quant_method, Int8W8A8LinearMethod) and down.weight.dtype == torch.int8
    out = greedy_generate(model, [[1, 2, 3]], 3)
    assert len(out[0]) == 3


def test_kv_cache_scales_load_and_reach_the_kernels(checkpoints, monkeypatch):
    """llm-compressor's kv_cache_scheme writes self_attn.k_scale / v_scale: each attention layer
    loads its own, and with --kv-cache-dtype fp8 the store and attention kernels get them."""
    from safetensors.torch import load_file

    from atom_core.kernels import torch_ref

    out, _ = checkpoints
    path = out / "llama-fp8-kv"
    ckpt = load_file(str(path / "model.safetensors"))
    engine = LLMEngine(str(path), kv_cache_dtype="fp8")
    layers = engine.core.executor.runner.attention_layers
    for i, layer in enumerate(layers):
        want = (float(ckpt[f"model.layers.{i}.self_attn.k_scale"]), float(ckpt[f"model.layers.{i}.self_attn.v_scale"]))
        assert layer.kv_scales == want and want != (1.0, 1.0)
    seen = []
    store = torch_ref.store_kv_cache
    monkeypatch.setattr(torch_ref, "store_kv_cache",
                        lambda *a, **k: seen.append((a[5], a[6])) or store(*a, **k))
    engine.generate([[5, 6, 7]], GREEDY)
    assert {layer.kv_scales for layer in layers} <= set(seen)
    assert all(s == (1.0, 1.0) for s in (layer.kv_scales for layer in LLMEngine(str(out / "llama-fp8-dynamic"))
                                         .core.executor.runner.attention_layers))  # no scales: 1.0
