"""W4A16 experts: the reference (`quant.int4_moe.fused_moe_w4a16_ref`) and the fused Triton kernel
(`kernels/triton/moe_w4a16.fused_moe_w4a16`), on fresh random int4 experts in the canonical layout.

- the reference equals a per-token oracle over weights dequantized by hand (u - zero) * scale;
- the kernel equals the reference: `cpu` cases under Triton's interpreter (group 32/64/128,
  symmetric and asymmetric, top-k 1/2/8, 1/7/64/300 tokens, every tile tier), `cuda` cases (marker
  `gpu`, not run yet: no GPU in the session that wrote them) at Qwen3-30B-A3B's expert shape and a
  CUDA-graph replay; both GEMMs compile offline for sm_90 without spills.

    TRITON_INTERPRET=1 python -m pytest tests/quant/test_w4a16_moe.py -q
"""
from __future__ import annotations

import zlib
from types import SimpleNamespace

import pytest
import torch

from atom_core.kernels import moe_ref
from atom_core.quant.int4_moe import fused_moe_w4a16_ref
from atom_core.quant.int_ops import pack_int4
from tests.kernels.conftest import device  # noqa: F401  (the cpu-interpreter / cuda fixture)
from tests.kernels.tolerances import INTERPRET, TOL, rel_err
from tests.quant.moe_layers import bf16_moe_layer


def seeded(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def int4_experts(gen, experts: int, rows: int, cols: int, group: int, dtype, asym: bool):
    """(packed int32 [E, R, C/8], scales [E, R, C/G], zeros uint8 or None, u uint8 [E, R, C])."""
    u = torch.randint(0, 16, (experts, rows, cols), dtype=torch.uint8, generator=gen)
    scale = ((torch.rand(experts, rows, cols // group, generator=gen) + 0.5) / (4 * cols ** 0.5)).to(dtype)
    zero = torch.randint(4, 12, (experts, rows, cols // group), dtype=torch.uint8, generator=gen) if asym else None
    return pack_int4(u, -1), scale, zero, u


def kernel_inputs(key, e, h, i, t, k, group, dtype, device, asym=False, drop=False):
    gen = seeded(*key)
    w13, s13, z13, _ = int4_experts(gen, e, 2 * i, h, group, dtype, asym)
    w2, s2, z2, _ = int4_experts(gen, e, h, i, group, dtype, asym)
    x = torch.randn(t, h, generator=gen).to(dtype)
    weights, ids = moe_ref.moe_route(torch.randn(t, e, generator=gen), k, renormalize=True)
    if drop:
        ids[::2, 0] = -1
        ids[1::3, -1] = e
    move = lambda v: None if v is None else v.to(device)  # noqa: E731
    return [move(a) for a in (x, w13, s13, z13, w2, s2, z2, weights, ids)]


class TestReference:
    @pytest.mark.parametrize("asym", [False, True])
    def test_equals_a_hand_dequantized_oracle(self, asym):
        e, h, i, t, k, g = 4, 64, 32, 5, 2, 32
        gen = seeded("ref", asym)
        w13, s13, z13, u13 = int4_experts(gen, e, 2 * i, h, g, torch.float32, asym)
        w2, s2, z2, u2 = int4_experts(gen, e, h, i, g, torch.float32, asym)
        x = torch.randn(t, h, generator=gen)
        weights, ids = moe_ref.moe_route(torch.randn(t, e, generator=gen), k, renormalize=True)

        def dq(u, s, z):
            zz = 8.0 if z is None else z.float().repeat_interleave(g, -1)
            return (u.float() - zz) * s.repeat_interleave(g, -1)

        a, b = dq(u13, s13, z13), dq(u2, s2, z2)
        oracle = torch.zeros(t, h)
        for tok in range(t):
            for slot in range(k):
                ex = int(ids[tok, slot])
                hh = a[ex] @ x[tok]
                oracle[tok] += weights[tok, slot] * (b[ex] @ (torch.nn.functional.silu(hh[:i]) * hh[i:]))
        out = fused_moe_w4a16_ref(x, w13, s13, z13, w2, s2, z2, weights, ids, g)
        assert torch.allclose(out, oracle, rtol=1e-5, atol=1e-6)


# (E, H, I, T, top_k, group): top-k 1/2/8, 1/7/64/300 tokens, groups 32/64/128
SMALL = [(4, 128, 128, 1, 1, 128), (8, 64, 96, 7, 2, 32), (16, 64, 64, 64, 8, 64), (4, 64, 32, 300, 1, 32)]


class TestTritonW4a16Moe:
    @pytest.mark.parametrize("shape", SMALL)
    @pytest.mark.parametrize("asym", [False, True])
    def test_matches_reference_float32(self, device, shape, asym):
        from atom_core.kernels.triton.moe_w4a16 import fused_moe_w4a16

        *dims, g = shape
        args = kernel_inputs(("f32", shape, asym), *dims, g, torch.float32, device, asym)
        assert rel_err(fused_moe_w4a16(*args, g), fused_moe_w4a16_ref(*args, g)) < TOL[torch.float32]

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_matches_reference_half(self, device, dtype):
        from atom_core.kernels.triton.moe_w4a16 import fused_moe_w4a16

        args = kernel_inputs(("half", dtype), 8, 64, 96, 7, 2, 32, dtype, device)
        out = fused_moe_w4a16(*args, 32)
        assert out.dtype == dtype and rel_err(out, fused_moe_w4a16_ref(*args, 32)) < TOL[dtype]

    @pytest.mark.parametrize("tier_tokens", [1, 24, 96, 400])
    def test_every_default_tile_tier_and_dropped_ids(self, device, tier_tokens):
        from atom_core.kernels.triton.moe_w4a16 import default_w4a16_moe_config, fused_moe_w4a16

        cfg = default_w4a16_moe_config(tier_tokens, 4, 8, 64)
        args = kernel_inputs(("tier", tier_tokens), 8, 128, 64, 6, 2, 64, torch.float32, device, drop=True)
        out = fused_moe_w4a16(*args, 64, config=cfg)
        assert rel_err(out, fused_moe_w4a16_ref(*args, 64)) < TOL[torch.float32]

    def test_bad_arguments_are_clear_errors(self):
        from atom_core.kernels.triton.moe_w4a16 import fused_moe_w4a16

        x, w13, s13, z13, w2, s2, z2, weights, ids = kernel_inputs(("bad",), 2, 64, 32, 3, 1, 32, torch.float32,
                                                                   "cpu", asym=True)
        with pytest.raises(ValueError, match="group size"):
            fused_moe_w4a16(x, w13, s13, z13, w2, s2, z2, weights, ids, 48)
        with pytest.raises(ValueError, match="both w13_zero and w2_zero"):
            fused_moe_w4a16(x, w13, s13, z13, w2, s2, None, weights, ids, 32)
        with pytest.raises(ValueError, match="hidden's dtype"):
            fused_moe_w4a16(x, w13, s13.half(), z13, w2, s2, z2, weights, ids, 32)
        with pytest.raises(ValueError, match="int32 words"):
            fused_moe_w4a16(x, w13.long(), s13, z13, w2, s2, z2, weights, ids, 32)
        with pytest.raises(ValueError, match="w2_scale must be"):
            fused_moe_w4a16(x, w13, s13, z13, w2, s2[:, :, :0], z2, weights, ids, 32)


# ---------------------------------------------------------------------------------------------
# checkpoints written by llm-compressor (its own venv, tests/quant/llmcompressor_checkpoints.py)


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    from tests.quant.llmcompressor_checkpoints import MOE_SCHEMES, make_checkpoints

    out = tmp_path_factory.mktemp("llmcompressor-moe")
    return out, make_checkpoints(out, list(MOE_SCHEMES))


@pytest.mark.skipif(INTERPRET, reason="engine test: runs the torch reference, not the interpreter")
class TestLlmCompressorCheckpoints:
    """Tiny Qwen3-MoE models (8 experts, top-2; attention and experts W4A16, group 32 and 128) as
    llm-compressor 0.14 writes them. HF transformers (in the llm-compressor venv) dequantizes the
    experts to float32 when it loads them; we dequantize the same integers with the same scales in
    float32 and multiply in float32, so the greedy tokens must equal HF's exactly (as for the dense
    W4A16 checkpoints in test_compressed_tensors.py)."""

    @pytest.mark.parametrize("name", ["qwen3moe-w4a16-g32", "qwen3moe-w4a16-g128"])
    def test_matches_hf_token_for_token(self, moe_checkpoints, name):
        import json

        from atom_core import LLMEngine, SamplingParams
        from tests.quant.llmcompressor_checkpoints import MAX_TOKENS, prompts

        out, reference = moe_checkpoints
        vocab = json.loads((out / name / "config.json").read_text())["vocab_size"]
        greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        got = [o["token_ids"] for o in LLMEngine(str(out / name)).generate(prompts(vocab), greedy)]
        assert got == reference[name]

    def test_experts_get_the_w4a16_moe_method(self, moe_checkpoints):
        from transformers import AutoConfig

        from atom_core.loader import build_model
        from atom_core.quant import get_quant_config
        from atom_core.quant.int4 import CompressedTensorsW4A16Method
        from atom_core.quant.int4_moe import CompressedTensorsW4A16MoEMethod

        out, _ = moe_checkpoints
        cfg = AutoConfig.from_pretrained(str(out / "qwen3moe-w4a16-g32"))
        model = build_model(cfg, out / "qwen3moe-w4a16-g32", torch.float32, "cpu", quant_config=get_quant_config(cfg))
        layer = model.model.layers[0]
        experts = layer.mlp.experts
        assert isinstance(experts.quant_method, CompressedTensorsW4A16MoEMethod)
        assert experts.quant_method.group_size == 32
        assert experts.w13_weight_packed.shape == (8, 128, 8) and experts.w2_weight_scale.shape == (8, 64, 2)
        assert not hasattr(experts, "w13_weight_shape")  # checked at load, then dropped
        assert isinstance(layer.self_attn.qkv_proj.quant_method, CompressedTensorsW4A16Method)
        assert layer.mlp.gate.weight.dtype == torch.float32  # the router stays unquantized


class TestParallelLoading:
    """Per-expert checkpoint tensors (llm-compressor's names) through the real loader: TP ranks hold
    their slice of I (gate/up rows, down's words and scale groups) and sum to the full layer; an EP
    rank holds whole experts."""

    E, H, I, G = 4, 64, 128, 32

    def _checkpoint(self, gen) -> dict[str, torch.Tensor]:
        tensors = {}
        for e in range(self.E):
            for proj, (rows, cols) in (("gate_proj", (self.I, self.H)), ("up_proj", (self.I, self.H)),
                                       ("down_proj", (self.H, self.I))):
                packed, scale, _, _ = int4_experts(gen, 1, rows, cols, self.G, torch.float32, False)
                base = f"model.layers.0.mlp.experts.{e}.{proj}"
                tensors.update({f"{base}.weight_packed": packed[0], f"{base}.weight_scale": scale[0],
                                f"{base}.weight_shape": torch.tensor([rows, cols])})
        return tensors

    def _layer(self, tensors, tmp_path):
        from safetensors.torch import save_file
        from torch import nn

        from atom_core.loader import process_weights_after_loading
        from atom_core.loader.weights import load_weights
        from atom_core.model_ops.moe import FusedMoE, MoERouting, make_expert_params_mapping
        from atom_core.quant.compressed_tensors import CompressedTensorsConfig

        weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": self.G}
        qc = CompressedTensorsConfig.from_config({"config_groups": {"g": {
            "targets": ["Linear"], "format": "pack-quantized", "weights": weights}}, "ignore": ["lm_head"]})
        holder = nn.Module()
        holder.model = nn.Module()
        holder.model.layers = nn.ModuleList([nn.Module()])
        holder.model.layers[0].mlp = nn.Module()
        experts = FusedMoE(self.E, self.H, self.I, MoERouting(top_k=2), "model.layers.0.mlp.experts", qc)
        holder.model.layers[0].mlp.experts = experts
        holder.config = SimpleNamespace()
        holder.expert_params_mapping = make_expert_params_mapping(self.E, "gate_proj", "down_proj", "up_proj")
        save_file(tensors, str(tmp_path / "model.safetensors"))
        load_weights(holder, tmp_path)
        process_weights_after_loading(holder)
        return experts

    def test_tensor_parallel_slices_sum_to_the_full_layer(self, tmp_path, monkeypatch):
        from atom_core.distributed import parallel_state

        gen = seeded("tp")
        tensors = self._checkpoint(gen)
        full = self._layer(tensors, tmp_path)
        x = torch.randn(5, self.H, generator=gen)
        weights, ids = moe_ref.moe_route(torch.randn(5, self.E, generator=gen), 2, renormalize=True)
        expected = full.quant_method.apply(full, x, weights, ids)
        total, part = torch.zeros_like(expected), self.I // 2
        for rank in range(2):
            monkeypatch.setitem(parallel_state._GROUPS, "tp", parallel_state.GroupCoordinator(
                "tp", (0, 1), rank, None, None))
            layer = self._layer(tensors, tmp_path)
            rows = torch.cat([torch.arange(rank * part, (rank + 1) * part),
                              self.I + torch.arange(rank * part, (rank + 1) * part)])
            assert torch.equal(layer.w13_weight_packed, full.w13_weight_packed[:, rows])
            words = slice(rank * part // 8, (rank + 1) * part // 8)
            assert torch.equal(layer.w2_weight_packed, full.w2_weight_packed[:, :, words])
            assert torch.equal(layer.w2_weight_scale, full.w2_weight_scale[:, :, rank * part // self.G:
                                                                           (rank + 1) * part // self.G])
            total += layer.quant_method.apply(layer, x, weights, ids)
        assert rel_err(total, expected) < 1e-6

    def test_expert_parallel_rank_holds_whole_experts(self, tmp_path, monkeypatch):
        from atom_core.distributed import parallel_state, set_expert_parallel

        tensors = self._checkpoint(seeded("ep"))
        full = self._layer(tensors, tmp_path)
        monkeypatch.setitem(parallel_state._GROUPS, "tp", parallel_state.GroupCoordinator("tp", (0, 1), 1, None, None))
        set_expert_parallel(True)
        try:
            layer = self._layer(tensors, tmp_path)
        finally:
            set_expert_parallel(False)
        for name in ("w13_weight_packed", "w13_weight_scale", "w2_weight_packed", "w2_weight_scale"):
            assert torch.equal(getattr(layer, name), getattr(full, name)[2:]), name

    def test_a_wrong_weight_shape_is_an_error(self, tmp_path):
        tensors = self._checkpoint(seeded("shape"))
        tensors["model.layers.0.mlp.experts.1.down_proj.weight_shape"] = torch.tensor([self.H, self.I + 8])
        with pytest.raises(ValueError, match=r"expert 1 w2 weight_shape \[64, 136\], expected \[64, 128\]"):
            self._layer(tensors, tmp_path)


def test_qwen3_30b_a3b_w4a16_preset_builds_w4a16_experts_with_dummy_weights():
    """preset:Qwen3-30B-A3B-W4A16 at toy sizes: experts get the W4A16 MoE method, dummy weights fill
    the int4 layout, and the model generates (CPU: the reference)."""
    from atom_core.loader import build_model
    from atom_core.loader.model_dir import resolve_model_files
    from atom_core.quant import get_quant_config
    from atom_core.quant.int4_moe import CompressedTensorsW4A16MoEMethod
    from tests.models.harness import greedy_generate

    cfg = resolve_model_files("preset:Qwen3-30B-A3B-W4A16").hf_config
    qc = get_quant_config(cfg)
    for key, value in dict(hidden_size=256, moe_intermediate_size=128, intermediate_size=512, num_hidden_layers=1,
                           vocab_size=300, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                           num_experts=8, num_experts_per_tok=2).items():
        setattr(cfg, key, value)
    model = build_model(cfg, None, torch.float32, "cpu", load_format="dummy", quant_config=qc)
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts.quant_method, CompressedTensorsW4A16MoEMethod) and experts.quant_method.group_size == 128
    assert experts.w13_weight_packed.shape == (8, 256, 32) and not hasattr(experts, "w2_weight_shape")
    assert len(greedy_generate(model, [[1, 2, 3]], 3)[0]) == 3


def test_bench_refuses_bad_arguments_and_runs_only_on_cuda(monkeypatch):
    from benchmarks.kernels import w4a16_moe_bench

    for argv, match in ((["--shapes", "llama"], "unknown shape"), (["--group", "96"], "expected one of"),
                        (["--shapes", "deepseek-v3"], "needs a CUDA GPU")):
        monkeypatch.setattr("sys.argv", ["w4a16_moe_bench", *argv])
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        with pytest.raises(SystemExit, match=match):
            w4a16_moe_bench.main()


class TestConfig:
    def _config(self, weights: dict):
        from atom_core.quant.compressed_tensors import CompressedTensorsConfig

        return CompressedTensorsConfig.from_config({"config_groups": {"group_0": {
            "targets": ["Linear"], "format": "pack-quantized", "weights": weights}}, "ignore": ["lm_head"]})

    def _experts(self, qc):
        from atom_core.model_ops.moe import FusedMoE, MoERouting

        return FusedMoE(4, 64, 64, MoERouting(top_k=2), "model.layers.0.mlp.experts", qc)

    def test_symmetric_groups_get_the_moe_method(self):
        from atom_core.quant.int4_moe import CompressedTensorsW4A16MoEMethod

        qc = self._config({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64})
        assert isinstance(self._experts(qc).quant_method, CompressedTensorsW4A16MoEMethod)

    @pytest.mark.parametrize("weights,what", [
        ({"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32}, "asymmetric"),
        ({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel"}, "channel"),
    ])
    def test_other_expert_schemes_are_refused_at_start(self, weights, what):
        with pytest.raises(ValueError, match=f"MoE experts with format 'pack-quantized', weights .*{what}.* are not "
                                             f"supported"):
            self._experts(self._config(weights))

    def test_intermediate_size_not_a_multiple_of_the_group_is_refused(self):
        from atom_core.model_ops.moe import FusedMoE, MoERouting

        qc = self._config({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128})
        with pytest.raises(ValueError, match="multiples of the group size 128"):
            FusedMoE(4, 128, 64, MoERouting(top_k=2), "model.layers.0.mlp.experts", qc)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="interpreter mode")
class TestOnCuda:
    @pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
    @pytest.mark.parametrize("group", [32, 128])
    def test_qwen3_30b_a3b_expert_shape(self, num_tokens, group):
        from atom_core.kernels.triton.moe_w4a16 import fused_moe_w4a16

        args = kernel_inputs(("gpu", num_tokens, group), 128, 2048, 768, num_tokens, 8, group, torch.bfloat16, "cuda")
        assert rel_err(fused_moe_w4a16(*args, group), fused_moe_w4a16_ref(*args, group)) < TOL[torch.bfloat16]

    def test_layer_method_runs_the_kernel_on_cuda(self, monkeypatch):
        """CompressedTensorsW4A16MoEMethod.apply on a CUDA layer calls the fused kernel and equals the reference."""
        from atom_core.kernels.triton import moe_w4a16

        calls = []
        kernel = moe_w4a16.fused_moe_w4a16
        monkeypatch.setattr(moe_w4a16, "fused_moe_w4a16", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
        qc = TestConfig()._config({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                   "group_size": 64})
        args = kernel_inputs(("layer",), 8, 256, 128, 5, 2, 64, torch.bfloat16, "cuda")
        x, w13, s13, _, w2, s2 = args[:6]
        layer = bf16_moe_layer(qc, {"w13_weight_packed": w13, "w13_weight_scale": s13, "w2_weight_packed": w2,
                                    "w2_weight_scale": s2})
        logits = torch.randn(5, 8, device="cuda")
        out = layer(x, logits)
        weights, ids = moe_ref.moe_route(logits, 2, renormalize=True)
        ref = fused_moe_w4a16_ref(x, w13, s13, None, w2, s2, None, weights, ids, 64)
        assert calls and rel_err(out, ref) < TOL[torch.bfloat16]

    def test_replays_in_a_cuda_graph(self):
        from atom_core.kernels.triton.moe_w4a16 import fused_moe_w4a16

        args = kernel_inputs(("graph",), 128, 2048, 768, 4, 8, 128, torch.bfloat16, "cuda")
        x, ids = args[0], args[8]
        fused_moe_w4a16(*args, 128)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_moe_w4a16(*args, 128)
        x.copy_(torch.randn_like(x))
        ids.copy_(torch.randperm(128, device="cuda")[:ids.numel()].view_as(ids).to(torch.int32))
        graph.replay()
        assert torch.equal(out, fused_moe_w4a16(*args, 128))


@pytest.mark.skipif(INTERPRET, reason="the interpreter replaces the compiled kernels")
@pytest.mark.parametrize("num_tokens", [1, 24, 96, 4096])
def test_kernels_compile_for_hopper_without_spills(num_tokens):
    """Both GEMMs compile for sm_90 offline (Triton's bundled toolchain) at Qwen3-30B-A3B's expert
    shape, group 128, each default tier, with no local-memory spills."""
    import os
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from atom_core.kernels.triton import moe_w4a16

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        pytest.skip("Triton ships no cuobjdump here")
    cfg = moe_w4a16.default_w4a16_moe_config(num_tokens, 8, 128, 128)
    ints = lambda *names: {n: "i32" for n in names}  # noqa: E731
    common = {"sorted_ptr": "*i32", "expert_ids_ptr": "*i32", "num_post_ptr": "*i32"}

    def compile_(fn, sig, consts, tile):
        aligned = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
                   if t.startswith("*") or n in ("stride_xt", "stride_at", "stride_we", "stride_wn", "stride_ot")}
        consts = {**consts, "GROUP": 128, "HAS_ZERO": False, "BLOCK_M": cfg.block_m, "BLOCK_N": tile.block_n,
                  "BLOCK_K": tile.block_k, "GROUP_M": tile.group_m, "DOT_IN_FP32": False, "DOT_PRECISION": None}
        src = ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in consts}}, constexprs=consts,
                        attrs=aligned)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": tile.num_warps, "num_stages": tile.num_stages})

    k1 = compile_(moe_w4a16._gemm1_kernel,
                  {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16", "out_ptr": "*bf16", **common,
                   **ints("num_assignments", "num_m_blocks"), "limit": "fp32",
                   **ints("stride_xt", "stride_we", "stride_wn", "stride_se", "stride_sn", "stride_ot")},
                  {"INTER": 768, "HIDDEN": 2048, "TOP_K": 8, "ACTIVATION": 0}, cfg.gemm1)
    k2 = compile_(moe_w4a16._gemm2_kernel,
                  {"a_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16", "topk_weights_ptr": "*fp32",
                   "out_ptr": "*bf16", **common,
                   **ints("num_assignments", "num_m_blocks", "stride_at", "stride_we", "stride_wn", "stride_se",
                          "stride_sn", "stride_ot")},
                  {"HIDDEN": 2048, "INTER": 768}, cfg.gemm2)
    for kernel in (k1, k2):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage
