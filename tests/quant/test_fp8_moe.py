"""Block-FP8 experts: the reference (`quant.fp8.fused_moe_fp8_block_ref`) and the fused Triton kernel
(`kernels/triton/moe_fp8.fused_moe_fp8_block`).

- the reference equals a per-expert oracle built from the checkpoint's own [ceil(R/128), ceil(K/128)]
  block scales (`fp8_block_linear_ref` with block [128, G]), so the row-expanded layout the loader
  keeps changes nothing; ids outside [0, E) are dropped;
- the kernel equals the reference on fresh random inputs: `cpu` cases under Triton's interpreter
  (small shapes, H and I not multiples of 128, top-k 1/2/8, 1/7/64/300 tokens), `cuda` cases (marker
  `gpu`) at Qwen3-30B-A3B-FP8 and DeepSeek-V3 expert shapes, a CUDA-graph replay, and the layer's
  method dispatching to it on CUDA;
- both GEMMs compile for sm_90 offline (Triton's bundled ptxas) at the default tiles without spills.

    TRITON_INTERPRET=1 python -m pytest tests/quant/test_fp8_moe.py -q
    python -m pytest -m gpu tests/quant/test_fp8_moe.py -q   (not run on a GPU yet)

Tolerances: in float32 the kernel and the reference compute the same quantized products (e4m3
codes and scales identical; only the float32 summation order differs), so TOL[float32] holds. In
bf16 the reference rounds gate/up, silu and the product to bf16 separately (as an eager HF expert
does) and the kernel rounds the float32 activation once; a 1-ulp bf16 difference moves an element
across an e4m3 rounding point with probability ~1/16, and that element then differs by one e4m3
step (1/8-1/16 of it) in the down projection's input: a few % relative L2 on small problems
(measured 1.3-3.0% in bf16 and 0.5-1.6% in fp16 under the interpreter, which also truncates
float32 -> bf16; 4.3% on a single token with top-1, too few elements to average, so the CPU cases
use 7-16 tokens). Against the exact product (the reference on float32 inputs) the kernel is as
close as the reference itself (1.3% vs 1.6-2.8% there). BF16_TOL = 4e-2 bounds that; an indexing
or scale error gives errors of order 1.
"""
from __future__ import annotations

import zlib

import pytest
import torch

from atom_core.kernels import moe_ref
from atom_core.quant.fp8 import fused_moe_fp8_block_ref
from atom_core.quant.fp8_ops import FP8_DTYPE, fp8_block_linear_ref, quantize_fp8_block
from tests.kernels.conftest import device  # noqa: F401  (the cpu-interpreter / cuda fixture)
from tests.kernels.tolerances import INTERPRET, TOL, rel_err, widen_fp8_dot_on_cuda
from tests.quant.moe_layers import bf16_moe_layer

BF16_TOL = 4e-2  # see the module docstring


def seeded(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def block_experts(gen, experts: int, rows: int, cols: int, group: int = 128):
    """Checkpoint-style experts: e4m3 [E, R, C] and block scales [E, ceil(R/128), ceil(C/G)] of
    random weights with unit-size dot products."""
    weights, scales = [], []
    for _ in range(experts):
        q, s = quantize_fp8_block(torch.randn(rows, cols, generator=gen) / cols ** 0.5, (128, group))
        weights.append(q)
        scales.append(s)
    return torch.stack(weights), torch.stack(scales)


def expand_rows(scales: torch.Tensor, rows: int) -> torch.Tensor:
    """[E, ceil(R/128), G] block scales -> [E, R, G], one row per weight row (the loader's layout)."""
    return scales.repeat_interleave(128, 1)[:, :rows].contiguous()


def route(gen, num_tokens: int, num_experts: int, top_k: int):
    return moe_ref.moe_route(torch.randn(num_tokens, num_experts, generator=gen), top_k, renormalize=True)


def kernel_inputs(key, e, h, i, t, k, dtype, device, group=128, drop=False):
    """(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids) with row-expanded scales."""
    gen = seeded(*key)
    w13, s13 = block_experts(gen, e, 2 * i, h, group)
    w2, s2 = block_experts(gen, e, h, i, group)
    x = torch.randn(t, h, generator=gen).to(dtype)
    weights, ids = route(gen, t, e, k)
    if drop:  # experts of another rank (EP): no contribution
        ids[::2, 0] = -1
        ids[1::3, -1] = e
    args = (x, w13, expand_rows(s13, 2 * i), w2, expand_rows(s2, h), weights, ids)
    return [a.to(device) for a in args]


class TestReference:
    @pytest.mark.parametrize("shape", [(4, 64, 96, 5, 2), (3, 200, 136, 4, 3)])
    def test_equals_a_per_expert_oracle_on_checkpoint_block_scales(self, shape):
        e, h, i, t, k = shape
        gen = seeded("ref", shape)
        w13, s13 = block_experts(gen, e, 2 * i, h)
        w2, s2 = block_experts(gen, e, h, i)
        x = torch.randn(t, h, generator=gen)
        weights, ids = route(gen, t, e, k)
        ids[0, 0] = -1  # dropped
        out = fused_moe_fp8_block_ref(x, w13, expand_rows(s13, 2 * i), w2, expand_rows(s2, h), weights, ids)
        oracle = torch.zeros(t, h)
        for tok in range(t):
            for slot in range(k):
                ex = int(ids[tok, slot])
                if not 0 <= ex < e:
                    continue
                hh = fp8_block_linear_ref(x[tok:tok + 1], w13[ex], s13[ex], [128, 128])
                y = fp8_block_linear_ref(moe_ref.apply_activation(hh, "silu"), w2[ex], s2[ex], [128, 128])
                oracle[tok] += weights[tok, slot] * y[0]
        assert torch.allclose(out, oracle, rtol=1e-5, atol=1e-6)

    def test_unknown_activation_is_an_error(self):
        args = kernel_inputs(("act",), 2, 32, 32, 1, 1, torch.float32, "cpu")
        with pytest.raises(ValueError, match="unknown activation"):
            fused_moe_fp8_block_ref(*args, 128, "gelu")


# (E, H, I, T, top_k): H / I not multiples of 128 (partial scale groups, K tails), top-k 1, 2, 8,
# 1 / 7 / 64 / 300 tokens; small enough for the interpreter on two cores
SMALL_SHAPES = [(4, 64, 96, 1, 1), (8, 200, 72, 7, 2), (16, 96, 64, 64, 8), (4, 48, 40, 300, 1)]


class TestTritonFp8Moe:
    @pytest.mark.parametrize("shape", SMALL_SHAPES)
    def test_matches_reference_float32(self, device, shape, monkeypatch):
        from atom_core.kernels.triton import moe_fp8
        from atom_core.kernels.triton.moe_fp8 import fused_moe_fp8_block

        widen_fp8_dot_on_cuda(monkeypatch, device, moe_fp8)

        args = kernel_inputs(("f32", shape), *shape, torch.float32, device)
        assert rel_err(fused_moe_fp8_block(*args), fused_moe_fp8_block_ref(*args)) < TOL[torch.float32]

    @pytest.mark.parametrize("shape", [(4, 64, 96, 16, 2), (8, 200, 72, 7, 2)])
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_matches_reference_half(self, device, shape, dtype):
        from atom_core.kernels.triton.moe_fp8 import fused_moe_fp8_block

        args = kernel_inputs(("half", shape, dtype), *shape, dtype, device)
        out = fused_moe_fp8_block(*args)
        assert out.dtype == dtype
        assert rel_err(out, fused_moe_fp8_block_ref(*args)) < BF16_TOL

    @pytest.mark.parametrize("tier_tokens", [1, 24, 96, 400])
    def test_every_default_tile_tier_and_dropped_ids(self, device, tier_tokens, monkeypatch):
        """Each tier of default_fp8_moe_config forced on a small float32 problem with K tails and ids
        outside [0, E) (experts of other ranks)."""
        from atom_core.kernels.triton import moe_fp8
        from atom_core.kernels.triton.moe_fp8 import default_fp8_moe_config, fused_moe_fp8_block

        widen_fp8_dot_on_cuda(monkeypatch, device, moe_fp8)
        cfg = default_fp8_moe_config(tier_tokens, 4, 8, 128)
        args = kernel_inputs(("tier", tier_tokens), 8, 160, 96, 6, 2, torch.float32, device, drop=True)
        out = fused_moe_fp8_block(*args, config=cfg)
        assert rel_err(out, fused_moe_fp8_block_ref(*args)) < TOL[torch.float32]

    def test_group_size_64_and_swigluoai(self, device):
        from atom_core.kernels.triton.moe_fp8 import fused_moe_fp8_block

        args = kernel_inputs(("g64",), 4, 192, 80, 5, 2, torch.float32, device, group=64)
        out = fused_moe_fp8_block(*args, 64, "swigluoai", 1.0)
        assert rel_err(out, fused_moe_fp8_block_ref(*args, 64, "swigluoai", 1.0)) < TOL[torch.float32]

    def test_bad_arguments_are_clear_errors(self):
        from atom_core.kernels.triton.moe import GemmTile, MoeConfig
        from atom_core.kernels.triton.moe_fp8 import fused_moe_fp8_block

        x, w13, s13, w2, s2, weights, ids = kernel_inputs(("bad",), 2, 64, 32, 3, 1, torch.float32, "cpu")
        with pytest.raises(ValueError, match="float8_e4m3fn"):
            fused_moe_fp8_block(x, w13.float(), s13, w2, s2, weights, ids)
        with pytest.raises(ValueError, match="w13_scale must be"):
            fused_moe_fp8_block(x, w13, s13[:, :, :0], w2, s2, weights, ids)
        with pytest.raises(ValueError, match="must be float32"):
            fused_moe_fp8_block(x, w13, s13.double(), w2, s2, weights, ids)
        with pytest.raises(ValueError, match="power of two"):
            fused_moe_fp8_block(x, w13, s13, w2, s2, weights, ids, 96)
        bad = MoeConfig(16, GemmTile(32, 256, 1, 4, 3), GemmTile(32, 128, 1, 4, 3))
        with pytest.raises(ValueError, match="dividing the group size"):
            fused_moe_fp8_block(x, w13, s13, w2, s2, weights, ids, config=bad)
        with pytest.raises(ValueError, match="topk_weights"):
            fused_moe_fp8_block(x, w13, s13, w2, s2, weights[:, :0], ids)


# ---------------------------------------------------------------------------------------------
# GPU (not run yet: written in a session without one)

# name -> (E, H, I, top_k): the released configs' expert shapes (Qwen3-30B-A3B-FP8: 128 experts of
# 2048 x 768, top-8; DeepSeek-V3: 256 experts of 7168 x 2048, top-8)
MODEL_SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8), "deepseek-v3": (256, 7168, 2048, 8)}


def random_block_fp8(num_experts: int, rows: int, cols: int, device: str = "cuda", group: int = 128):
    """e4m3 experts [E, R, C] (values spread over e4m3's range) and row-expanded scales
    [E, R, ceil(C/G)] making unit-size dot products; filled one expert at a time (bounded memory)."""
    gen = torch.Generator(device=device).manual_seed(rows * 31 + cols)
    w = torch.empty(num_experts, rows, cols, dtype=FP8_DTYPE, device=device)
    for e in range(num_experts):
        w[e] = (torch.randn(rows, cols, device=device, generator=gen) * 32).to(FP8_DTYPE)
    blocks = torch.rand(num_experts, -(-rows // 128), -(-cols // group), device=device, generator=gen) + 0.5
    return w, (blocks / (32 * cols ** 0.5)).repeat_interleave(128, 1)[:, :rows].contiguous()


def model_inputs(name: str, num_tokens: int):
    e, h, i, k = MODEL_SHAPES[name]
    w13, s13 = random_block_fp8(e, 2 * i, h)
    w2, s2 = random_block_fp8(e, h, i)
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, h, device="cuda", generator=gen).bfloat16()
    weights, ids = moe_ref.moe_route(torch.randn(num_tokens, e, device="cuda", generator=gen), k, renormalize=True)
    return [x, w13, s13, w2, s2, weights, ids]


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="interpreter mode")
class TestOnCuda:
    @pytest.mark.parametrize("name,num_tokens", [("qwen3-30b-a3b", m) for m in (1, 7, 64, 300)]
                             + [("deepseek-v3", m) for m in (1, 64)])
    def test_model_shapes_match_reference(self, name, num_tokens):
        from atom_core.kernels.triton.moe_fp8 import fused_moe_fp8_block

        args = model_inputs(name, num_tokens)
        assert rel_err(fused_moe_fp8_block(*args), fused_moe_fp8_block_ref(*args)) < BF16_TOL

    def test_replays_in_a_cuda_graph(self):
        """No host sync: a captured call replays to the eager result on new inputs."""
        from atom_core.kernels.triton.moe_fp8 import fused_moe_fp8_block

        args = model_inputs("qwen3-30b-a3b", 4)
        x, ids, e = args[0], args[6], MODEL_SHAPES["qwen3-30b-a3b"][0]
        fused_moe_fp8_block(*args)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_moe_fp8_block(*args)
        x.copy_(torch.randn_like(x))
        ids.copy_(torch.randperm(e, device="cuda")[:ids.numel()].view_as(ids).to(torch.int32))
        graph.replay()
        assert torch.equal(out, fused_moe_fp8_block(*args))
        assert rel_err(out, fused_moe_fp8_block_ref(*args)) < BF16_TOL

    def test_tiny_block_fp8_moe_engine_on_cuda_is_near_greedy_on_the_cpu_model(self, tmp_path):
        """An engine run of the format on the GPU: a tiny Qwen3-MoE written as a block-FP8 checkpoint
        (test_fp8_models' writer), generated on CUDA (the fused kernel for the experts, graphs on).
        Oracle: our CPU model of the same files (checked against HF in test_fp8_models; HF itself
        would run its own FP8 kernels on a GPU machine). Every CUDA token must be near-greedy under
        it, with test_fp8_models' FLIP bound (an activation's e4m3 rounding may flip)."""
        from atom_core import LLMEngine
        from tests.models.harness import prompt_logits
        from tests.quant.test_fp8_models import FLIP, GREEDY, _build, prompts, write_block_fp8
        from tests.tiny_models import build_tiny_model

        write_block_fp8(build_tiny_model(tmp_path / "bf16", "qwen3_moe"), tmp_path / "fp8")
        path = tmp_path / "fp8"
        cpu_model = _build(path)
        plist = prompts(cpu_model.config.vocab_size)
        engine = LLMEngine(str(path), device="cuda", dtype="float32", num_kv_blocks=512)
        for prompt, out in zip(plist, engine.generate(plist, GREEDY)):
            tokens = out["token_ids"]
            logits = prompt_logits(cpu_model, prompt + tokens[:-1])[len(prompt) - 1:]
            chosen = logits.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
            assert (logits.max(1).values - chosen).max() < FLIP

    def test_layer_method_runs_the_kernel_on_cuda(self, monkeypatch):
        """Fp8BlockMoEMethod.apply on a CUDA layer calls the fused kernel (and equals the reference)."""
        from atom_core.kernels.triton import moe_fp8
        from atom_core.quant.fp8 import Fp8Config

        calls = []
        kernel = moe_fp8.fused_moe_fp8_block
        monkeypatch.setattr(moe_fp8, "fused_moe_fp8_block", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
        qc = Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [128, 128]})
        w13, s13 = random_block_fp8(8, 256, 256)
        w2, s2 = random_block_fp8(8, 256, 128)
        layer = bf16_moe_layer(qc, {"w13_weight": w13, "w13_weight_scale_inv": s13, "w2_weight": w2,
                                    "w2_weight_scale_inv": s2})
        x = torch.randn(5, 256, device="cuda").bfloat16()
        logits = torch.randn(5, 8, device="cuda")
        out = layer(x, logits)
        weights, ids = moe_ref.moe_route(logits, 2, renormalize=True)
        assert calls and rel_err(out, fused_moe_fp8_block_ref(x, w13, s13, w2, s2, weights, ids)) < BF16_TOL


def test_qwen3_30b_a3b_fp8_preset_builds_block_fp8_experts_with_dummy_weights():
    """preset:Qwen3-30B-A3B-FP8 (the bf16 preset + the published block-FP8 quantization_config) at
    toy sizes: experts and attention get the block-FP8 methods, the router and lm_head stay in the
    model dtype, dummy weights fill the e4m3 layout, and the model runs (CPU: the reference)."""
    from atom_core.loader import build_model
    from atom_core.loader.model_dir import resolve_model_files
    from atom_core.quant import get_quant_config
    from atom_core.quant.fp8 import Fp8BlockLinearMethod, Fp8BlockMoEMethod
    from tests.models.harness import greedy_generate

    cfg = resolve_model_files("preset:Qwen3-30B-A3B-FP8").hf_config
    qc = get_quant_config(cfg)
    assert qc.block_size == (128, 128) and not qc.online
    for key, value in dict(hidden_size=256, moe_intermediate_size=128, intermediate_size=512, num_hidden_layers=1,
                           vocab_size=300, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                           num_experts=8, num_experts_per_tok=2).items():
        setattr(cfg, key, value)
    model = build_model(cfg, None, torch.float32, "cpu", load_format="dummy", quant_config=qc)
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp.experts.quant_method, Fp8BlockMoEMethod) and mlp.experts.w13_weight.dtype == FP8_DTYPE
    assert isinstance(model.model.layers[0].self_attn.qkv_proj.quant_method, Fp8BlockLinearMethod)
    assert mlp.gate.weight.dtype == torch.float32 and model.lm_head.weight.dtype == torch.float32
    assert len(greedy_generate(model, [[1, 2, 3]], 3)[0]) == 3


def test_bench_refuses_unknown_shapes_and_runs_only_on_cuda(monkeypatch):
    from benchmarks.kernels import fp8_moe_bench

    monkeypatch.setattr("sys.argv", ["fp8_moe_bench", "--shapes", "qwen3-30b-a3b,llama"])
    with pytest.raises(SystemExit, match="unknown shape"):
        fp8_moe_bench.main()
    monkeypatch.setattr("sys.argv", ["fp8_moe_bench", "--shapes", "deepseek-v3"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        fp8_moe_bench.main()


# ---------------------------------------------------------------------------------------------
# offline sm_90 compile


@pytest.mark.skipif(INTERPRET, reason="the interpreter replaces the compiled kernels")
@pytest.mark.parametrize("num_tokens", [1, 24, 96, 4096])
def test_kernels_compile_for_hopper_without_spills(num_tokens):
    """Both GEMMs compile for sm_90 with Triton's bundled toolchain (no GPU needed) at Qwen3-30B-A3B's
    expert shape and each default tile tier, with e4m3 MMAs and no local-memory spills. Pointers and
    row strides carry the 16-divisibility Triton gives them at launch (else loads stay scalar)."""
    import os
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from atom_core.kernels.triton import moe_fp8

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        pytest.skip("Triton ships no cuobjdump here")

    def compile_(fn, sig, consts, tile):
        aligned = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
                   if t.startswith("*") or n in ("stride_xt", "stride_we", "stride_wn", "stride_ot", "stride_at")}
        src = ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in consts}}, constexprs=consts,
                        attrs=aligned)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": tile.num_warps, "num_stages": tile.num_stages})

    e, h, i, k = MODEL_SHAPES["qwen3-30b-a3b"]
    cfg = moe_fp8.default_fp8_moe_config(num_tokens, k, e, 128)
    ints = lambda *names: {n: "i32" for n in names}  # noqa: E731
    ptrs = {"sorted_ptr": "*i32", "expert_ids_ptr": "*i32", "num_post_ptr": "*i32"}
    tiles = lambda t: {"BLOCK_M": cfg.block_m, "BLOCK_N": t.block_n, "BLOCK_K": t.block_k,  # noqa: E731
                       "GROUP_M": t.group_m, "DOT_MODE": 0, "GROUP": 128}
    k1 = compile_(moe_fp8._gemm1_kernel,
                  {"xq_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "out_ptr": "*bf16",
                   **ptrs, **ints("num_assignments", "num_m_blocks"), "limit": "fp32",
                   **ints("stride_xt", "stride_xst", "stride_we", "stride_wn", "stride_wse", "stride_wsn",
                          "stride_ot")},
                  {"INTER": i, "HIDDEN": h, "TOP_K": k, "ACTIVATION": 0, **tiles(cfg.gemm1)}, cfg.gemm1)
    k2 = compile_(moe_fp8._gemm2_kernel,
                  {"aq_ptr": "*fp8e4nv", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32",
                   "topk_weights_ptr": "*fp32", "out_ptr": "*bf16", **ptrs,
                   **ints("num_assignments", "num_m_blocks", "stride_at", "stride_ast", "stride_we", "stride_wn",
                          "stride_wse", "stride_wsn", "stride_ot")},
                  {"HIDDEN": h, "INTER": i, **tiles(cfg.gemm2)}, cfg.gemm2)
    for kernel in (k1, k2):
        assert "e4m3" in kernel.asm["ptx"], "the MMAs should take e4m3 operands"
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage
