"""GPT-OSS against HF transformers greedy, token for token, on a tiny random model: window 8
(prompts and chunks cross it), random sinks, biases and norms, clamped SwiGLU whose clamps bite,
YaRN; under default settings, chunked prefill (chunks of 6 and 11: smaller than and crossing
the window), prefix caching and max_num_seqs=2. The loader's checks on expert tensors."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from atom_core import LLMEngine, SamplingParams
from atom_core.quant import supported_quantizations
from tests.models.harness import hf_greedy

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
LIMIT = 0.6  # swiglu_limit: small enough that the random weights' pre-activations cross it
NEEDS_MXFP4 = pytest.mark.skipif("mxfp4" not in supported_quantizations(), reason="MXFP4 is not registered yet")


def build_tiny_gpt_oss(path: Path, seed: int = 0, hidden_size: int = 32, intermediate_size: int = 24) -> Path:
    """3 layers (sliding, full, sliding; window 8), 4 heads / 2 kv heads of 8, hidden 32,
    4 experts top-2 of intermediate 24 (so [E, H, 2I], [E, 2I, H] and [E, I, H] all differ)."""
    import transformers as tf

    from tests.tiny_models import build_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = tf.GptOssConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
                             num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                             num_experts_per_tok=2, sliding_window=8, max_position_embeddings=256,
                             rope_parameters=dict(YARN), swiglu_limit=LIMIT, eos_token_id=eos, pad_token_id=0)
    torch.manual_seed(seed)
    model = tf.GptOssForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
        for name, t in model.state_dict().items():  # HF inits norms to 1, biases and sinks to ~0
            if "norm" in name:
                t.copy_(1 + 0.2 * torch.randn_like(t))
            elif "sinks" in name:
                t.copy_(torch.randn_like(t))
            elif "bias" in name:
                t.copy_(0.1 * torch.randn_like(t))
    model.save_pretrained(str(path))
    tf.GenerationConfig(eos_token_id=eos, pad_token_id=0).save_pretrained(str(path))
    return path


def _hf(path: Path, **overrides):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **overrides).eval()


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    path = build_tiny_gpt_oss(tmp_path_factory.mktemp("tiny_gpt_oss"))
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(3, vocab, (21,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 5, 30)]
    prompts.append(torch.randint(3, vocab, (3,), generator=g).tolist())  # shorter than the window
    hf = _hf(path)
    ref = hf_greedy(hf, prompts, MAX_TOKENS)
    return path, prompts, ref, hf


class TestFeaturesMatter:
    """Each feature changes HF's greedy output on these prompts, so matching it checks the feature."""

    @pytest.mark.parametrize("overrides", [
        {"sliding_window": 4096},  # no window
        {"swiglu_limit": 1e4},  # no clamp
    ], ids=["window", "clamp"])
    def test_config_feature_changes_the_output(self, gpt_oss, overrides):
        path, prompts, ref, _ = gpt_oss
        assert hf_greedy(_hf(path, **overrides), prompts, MAX_TOKENS) != ref

    def test_sinks_change_the_output(self, gpt_oss):
        path, prompts, ref, _ = gpt_oss
        hf = _hf(path)
        with torch.no_grad():
            for layer in hf.model.layers:
                layer.self_attn.sinks.fill_(-1e4)  # exp(-1e4) = 0: no sink
        assert hf_greedy(hf, prompts, MAX_TOKENS) != ref


@pytest.mark.parametrize("kwargs", [{}, {"max_num_batched_tokens": 6}, {"max_num_batched_tokens": 11},
                                    {"enable_prefix_caching": True}, {"max_num_seqs": 2}],
                         ids=["default", "chunk6", "chunk11", "prefix", "seqs2"])
def test_matches_hf_greedy(gpt_oss, kwargs):
    path, prompts, ref, _ = gpt_oss
    engine = LLMEngine(str(path), device="cpu", **kwargs)
    outs = engine.generate(prompts, GREEDY)
    if kwargs.get("enable_prefix_caching"):  # second pass: the 21-token shared prefix comes from the cache
        outs = engine.generate(prompts, GREEDY)
        assert engine.core.kv.num_hit_tokens > 0
    assert [o["token_ids"] for o in outs] == ref
    assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks


@pytest.mark.parametrize("options", [dict(max_num_batched_tokens=11), dict(enable_expert_parallel=True)],
                         ids=["tp2", "tp2_ep"])
def test_tensor_parallel_matches_hf(gpt_oss, options):
    """Two ranks on the CPU (gloo): heads, sinks and each expert's intermediate slice split (w2's
    bias added by rank 0 only), or whole experts per rank under expert parallelism."""
    path, prompts, ref, _ = gpt_oss
    engine = LLMEngine(str(path), device="cpu", tensor_parallel_size=2, kv_cache_memory_gb=0.02, **options)
    try:
        assert [o["token_ids"] for o in engine.generate(prompts, GREEDY)] == ref
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    """The published layout: experts as gate_up_proj_blocks/_scales (gate/up rows interleaved) and
    down_proj_blocks/_scales with bf16-era biases, quantization_config mxfp4; hidden 64 and
    intermediate 32 (whole 32-value scale groups). HF dequantizes it at load on the CPU (float32)."""
    from safetensors.torch import load_file, save_file

    path = build_tiny_gpt_oss(tmp_path_factory.mktemp("mxfp4"), hidden_size=64, intermediate_size=32)
    cfg = json.loads((path / "config.json").read_text())
    hidden, inter, experts = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    weights = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows, cols = (2 * inter, hidden) if name.endswith("gate_up_proj") else (hidden, inter)
        del weights[name]
        weights[f"{name}_blocks"] = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=g,
                                                  dtype=torch.uint8)
        # e8m0 exponents 2^-9 .. 2^-3: e2m1 values up to 6 make weights up to 0.75, pre-activations past the limit
        weights[f"{name}_scales"] = torch.randint(118, 125, (experts, rows, cols // 32), generator=g, dtype=torch.uint8)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(cfg))
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, cfg["vocab_size"], (n,), generator=gen).tolist() for n in (1, 9, 30)]
    # dequantize=True said, not left to the environment: with the `kernels` package installed (transformers
    # 5.25 pulls it in) HF's CPU load would fetch MXFP4 kernels from the hub instead of dequantizing
    from transformers import Mxfp4Config

    hf = _hf(path, quantization_config=Mxfp4Config(dequantize=True))
    return path, prompts, hf_greedy(hf, prompts, MAX_TOKENS)


@NEEDS_MXFP4
@pytest.mark.parametrize("options", [dict(max_num_batched_tokens=11), dict(tensor_parallel_size=2,
                                                                           enable_expert_parallel=True)],
                         ids=["chunk11", "tp2_ep"])
def test_mxfp4_checkpoint_matches_hf_dequantized(mxfp4_checkpoint, options):
    """We keep the experts in MXFP4 and run the reference MXFP4 MoE (whole experts per rank under EP)."""
    path, prompts, ref = mxfp4_checkpoint
    engine = LLMEngine(str(path), device="cpu", kv_cache_memory_gb=0.02, **options)
    try:
        if "tensor_parallel_size" not in options:
            experts = engine.core.executor.runner.model.model.layers[0].mlp.experts
            assert experts.w13_weight.dtype == torch.uint8
        assert [o["token_ids"] for o in engine.generate(prompts, GREEDY)] == ref
    finally:
        engine.shutdown()


@NEEDS_MXFP4
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_mxfp4_engine_matches_hf_dequantized(mxfp4_checkpoint):
    """The Triton MXFP4 MoE kernel (fp32 activations) in the whole model, against HF's dequantized load."""
    path, prompts, ref = mxfp4_checkpoint
    engine = LLMEngine(str(path), device="cuda", dtype="float32", max_num_batched_tokens=11)
    assert [o["token_ids"] for o in engine.generate(prompts, GREEDY)] == _reference(path, prompts, ref)


def test_prompt_logits_match_hf(gpt_oss):
    from transformers import AutoConfig

    from atom_core.loader import build_model
    from tests.models.harness import prompt_logits

    path, prompts, _, hf = gpt_oss
    model = build_model(AutoConfig.from_pretrained(str(path)), path, torch.float32, "cpu")
    with torch.no_grad():
        expected = hf(torch.tensor([prompts[2]])).logits[0]
    torch.testing.assert_close(prompt_logits(model, prompts[2]), expected, rtol=1e-4, atol=1e-4)


def test_compiled_layers_equal_eager(gpt_oss):
    """Decoder layers under torch.compile (fullgraph; attention and experts as opaque ops)."""
    from tests.models.harness import compiled_equals_eager

    compiled_equals_eager(gpt_oss[0])


def test_layers_declare_windows_and_sinks(gpt_oss):
    from atom_core.model_ops.kv_spec import attention_layers

    engine = LLMEngine(str(gpt_oss[0]), device="cpu")
    layers = attention_layers(engine.core.executor.runner.model)
    assert [layer.kv_spec.sliding_window for layer in layers] == [8, None, 8]
    assert all(layer.kv_spec.has_sinks and layer.sinks.dtype == torch.float32 for layer in layers)
    assert layers[0].qk.rotary is layers[1].qk.rotary  # one cos/sin cache for every layer


def _rewrite(src: Path, dst: Path, edit) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    edit(weights)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


class TestLoaderChecks:
    def test_rejects_gate_up_proj_in_our_orientation(self, gpt_oss, tmp_path):
        """[E, 2I, H] where HF's [E, H, 2I] is expected: named clearly, not loaded transposed."""
        def edit(w):
            name = "model.layers.1.mlp.experts.gate_up_proj"
            w[name] = w[name].transpose(1, 2).contiguous()

        path = _rewrite(gpt_oss[0], tmp_path / "bad", edit)
        with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts: checkpoint tensor of shape "
                                             r"\(4, 48, 32\) in the layout \[E, H, 2I\] / \[E, I, H\]"):
            LLMEngine(str(path), device="cpu")

    def test_rejects_a_wrong_expert_count(self, gpt_oss, tmp_path):
        def edit(w):
            w["model.layers.0.mlp.experts.down_proj_bias"] = w["model.layers.0.mlp.experts.down_proj_bias"][:3]

        path = _rewrite(gpt_oss[0], tmp_path / "bad", edit)
        with pytest.raises(ValueError, match=r"shape \(3, 32\) is not 4 experts"):
            LLMEngine(str(path), device="cpu")

    def test_rejects_sinks_of_the_wrong_head_count(self, gpt_oss, tmp_path):
        def edit(w):
            w["model.layers.2.self_attn.sinks"] = torch.zeros(5)

        path = _rewrite(gpt_oss[0], tmp_path / "bad", edit)
        with pytest.raises(ValueError, match=r"self_attn\.attn: sinks of shape \(5,\); expected \[4\]"):
            LLMEngine(str(path), device="cpu")

    def test_rejects_an_unsupported_swiglu_alpha(self, gpt_oss, tmp_path):
        path = shutil.copytree(gpt_oss[0], tmp_path / "alpha")
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(cfg | {"swiglu_alpha": 1.5}))
        with pytest.raises(ValueError, match="swiglu_alpha=1.5 is not supported"):
            LLMEngine(str(path), device="cpu")


class TestFusedMoEOptions:
    def _moe(self, **kwargs):
        from atom_core.model_ops.moe import FusedMoE, MoERouting

        return FusedMoE(4, 64, 32, MoERouting(top_k=2, renormalize=True), "model.layers.0.mlp.experts", **kwargs)

    def test_biases_are_registered_in_the_model_dtype(self):
        moe = self._moe(activation="swigluoai", swiglu_limit=7.0, has_bias=True)
        assert moe.w13_bias.shape == (4, 64) and moe.w2_bias.shape == (4, 64)
        assert moe.w13_bias.dtype == torch.get_default_dtype()
        assert not hasattr(self._moe(), "w13_bias")

    @pytest.mark.parametrize("kwargs,match", [
        (dict(activation="gelu"), "experts: unknown activation 'gelu'; expected one of: silu, swigluoai"),
        (dict(activation="swigluoai"), "experts: activation 'swigluoai' needs swiglu_limit > 0"),
    ])
    def test_bad_activation_fails_at_construction(self, kwargs, match):
        with pytest.raises(ValueError, match=match):
            self._moe(**kwargs)

    def test_block_fp8_experts_refuse_biases(self):
        from atom_core.quant.fp8 import Fp8Config

        quant = Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [128, 128]})
        with pytest.raises(ValueError, match="block-FP8 experts with biases .* are not supported"):
            self._moe(activation="swigluoai", swiglu_limit=7.0, has_bias=True, quant_config=quant)


def _build_preset(preset: str, quantized: bool) -> torch.nn.Module:
    from atom_core.loader.model_dir import resolve_model_files
    from atom_core.models.registry import resolve_model_class
    from atom_core.quant import get_quant_config

    config = resolve_model_files(f"preset:{preset}").hf_config
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            return resolve_model_class(config)(config, quant_config=get_quant_config(config) if quantized else None)
    finally:
        torch.set_default_dtype(old)


@pytest.mark.parametrize("preset,billions", [("gpt-oss-20b", 20.91), ("gpt-oss-120b", 116.83),
                                             ("gpt-oss-20b-BF16", 20.91)])
def test_presets_build_with_their_published_sizes(preset, billions):
    """The real configs in the bf16 layout, on the meta device: the model cards' totals (20.9B, 116.8B)."""
    model = _build_preset(preset, quantized=False)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == billions
    windows = [m.kv_spec.sliding_window for m in model.modules() if hasattr(m, "kv_spec")]
    assert windows == [128, None] * (len(windows) // 2)


@NEEDS_MXFP4
@pytest.mark.parametrize("preset,gib", [("gpt-oss-20b", 12.82), ("gpt-oss-120b", 60.77)])
def test_mxfp4_presets_hold_mxfp4_experts(preset, gib):
    """Their quantization_config makes the experts MXFP4 (17/32 bytes a weight: 4 bits plus an e8m0
    scale per 32) and leaves attention, router, embeddings and lm_head in bf16: 120b fits one H100."""
    model = _build_preset(preset, quantized=True)
    experts = model.model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == torch.uint8 and experts.w13_bias.dtype == torch.bfloat16
    assert model.model.layers[0].mlp.router.weight.dtype == torch.bfloat16
    assert round(sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30, 2) == gib


def _hf_reads_swiglu_limit() -> bool:
    """transformers before 5.18 hard-codes GptOssExperts' limit to 7.0 (the published value) and
    ignores config.swiglu_limit; these tiny models use 0.6 so the clamp bites."""
    import inspect

    from transformers.models.gpt_oss import modeling_gpt_oss

    return "config.swiglu_limit" in inspect.getsource(modeling_gpt_oss.GptOssExperts.__init__)


def _reference(path: Path, prompts: list, hf_ref: list) -> list:
    """HF's greedy tokens where this transformers honours the config; else our CPU engine's, which
    CI checks against a transformers that does (test_matches_hf_greedy)."""
    if _hf_reads_swiglu_limit():
        return hf_ref
    return [o["token_ids"] for o in LLMEngine(str(path), device="cpu", dtype="float32").generate(prompts, GREEDY)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("eager", [False, True], ids=["graphs_compiled", "eager"])
def test_cuda_engine_matches_hf(gpt_oss, eager):
    """The Triton path (paged attention with windows and sinks, the swigluoai MoE kernel, CUDA
    graphs and torch.compile by default) in fp32 against HF on the CPU, with chunked prefill."""
    path, prompts, ref, _ = gpt_oss
    engine = LLMEngine(str(path), device="cuda", dtype="float32", max_num_batched_tokens=11, enforce_eager=eager)
    assert [o["token_ids"] for o in engine.generate(prompts, GREEDY)] == _reference(path, prompts, ref)
    assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks
