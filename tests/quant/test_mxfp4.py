"""MXFP4 experts: the format against HF transformers' own code, the loader, the CPU reference and
the Triton kernel.

- dequantization equals `transformers.integrations.mxfp4.convert_moe_packed_tensors` bit for bit;
- a FusedMoE loaded from GPT-OSS checkpoint tensors (interleaved gate/up, through the real loader)
  equals HF's `GptOssExperts` run on HF's own dequantization of the same tensors;
- TP slices sum to the full layer; EP ranks hold whole experts; unsupported splits fail clearly;
- the Triton kernel equals the reference: `cpu` cases under Triton's interpreter (small shapes),
  `cuda` cases (marker `gpu`) incl. GPT-OSS-20b's shapes; both its paths (the decode GEMVs of
  moe_mxfp4_decode for T * top_k <= 32, the tiled tl.dot kernels above) and the choice between them:
    TRITON_INTERPRET=1 python -m pytest tests/quant/test_mxfp4.py -q
    python -m pytest -m gpu tests/quant/test_mxfp4.py -q
"""
from __future__ import annotations

import math
import zlib
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from atom_core.distributed import parallel_state, set_expert_parallel
from atom_core.kernels import moe_ref
from atom_core.kernels.triton.moe_mxfp4_decode import GEMV1_TILE, GEMV2_TILE
from atom_core.model_ops.linear import ReplicatedLinear
from atom_core.model_ops.moe import FusedMoE, MoERouting
from atom_core.quant import get_quant_config
from atom_core.quant.mxfp4 import (
    Mxfp4Config, Mxfp4MoEMethod, dequantize_mxfp4, fused_moe_mxfp4_ref, mxfp4_expert_params_mapping,
)
from tests.kernels.tolerances import INTERPRET, TOL, rel_err

GPT_OSS_QC = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                         "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}
PREFIX = "model.layers.0.mlp.experts"


@pytest.fixture(params=[
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(INTERPRET, reason="interpreter mode")]),
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1 to run on CPU")),
])
def device(request) -> str:
    return request.param


def seeded(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def hf_dequantize(blocks4: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """HF's dequantization of checkpoint tensors [E, R, K/32, 16] -> [E, K, R] (its layout)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks4, scales, dtype=dtype)


def random_mx(gen: torch.Generator, experts: int, rows: int, k: int,
              spread: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint-shaped blocks [E, R, K/32, 16] and scales [E, R, K/32] whose values keep a
    K-long dot product near unit size (exponents around 2^-(log2(sqrt K) + 2))."""
    center = 127 - round(math.log2(math.sqrt(k))) - 2
    blocks = torch.randint(0, 256, (experts, rows, k // 32, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(center - spread, center + spread + 1, (experts, rows, k // 32), dtype=torch.uint8,
                           generator=gen)
    return blocks, scales


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


class TestDequantize:
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
    def test_bits_equal_hf_for_every_scale(self, dtype):
        gen = seeded("dequant", dtype)
        blocks = torch.randint(0, 256, (2, 16, 8, 16), dtype=torch.uint8, generator=gen)
        scales = torch.arange(2 * 16 * 8).remainder(256).to(torch.uint8).reshape(2, 16, 8)  # all 256 exponents
        ref = hf_dequantize(blocks, scales, dtype).transpose(1, 2)
        assert torch.equal(bits(dequantize_mxfp4(blocks, scales, dtype)), bits(ref))

    def test_flat_blocks_and_e8m0_scales_give_the_same_values(self):
        blocks, scales = random_mx(seeded("flat"), 2, 8, 64)
        ref = dequantize_mxfp4(blocks, scales, torch.float32)
        out = dequantize_mxfp4(blocks.flatten(-2), scales.view(torch.float8_e8m0fnu), torch.float32)
        assert torch.equal(out, ref)

    def test_mismatched_shapes_are_an_error(self):
        blocks, scales = random_mx(seeded("bad"), 1, 4, 64)
        with pytest.raises(ValueError, match="do not match scales"):
            dequantize_mxfp4(blocks.flatten(-2)[..., :-16], scales, torch.float32)


class TestConfig:
    def config(self) -> Mxfp4Config:
        qc = get_quant_config(SimpleNamespace(quantization_config=dict(GPT_OSS_QC)))
        assert isinstance(qc, Mxfp4Config)
        return qc

    @pytest.mark.parametrize("name,converted", [
        ("model.layers.0.mlp.experts", True), ("model.layers.23.mlp.experts", True),
        ("model.layers.3.self_attn", False), ("model.layers.3.self_attn.qkv_proj", False),
        ("model.layers.11.mlp.router", False), ("model.embed_tokens", False), ("lm_head", False),
    ])
    def test_modules_to_not_convert_as_hf_reads_them(self, name, converted):
        from transformers.quantizers.quantizers_utils import should_convert_module

        assert self.config().is_converted(name) is converted
        assert should_convert_module(name, GPT_OSS_QC["modules_to_not_convert"]) is converted

    def test_experts_get_the_method_and_dense_layers_stay_unquantized(self):
        qc = self.config()
        layer = _moe_layer(qc, 4, 64, 64, top_k=2)
        assert isinstance(layer.quant_method, Mxfp4MoEMethod)
        assert layer.w13_weight.dtype == torch.uint8 and layer.w13_weight_scale.dtype == torch.float8_e8m0fnu
        # Only experts are MXFP4 in every checkpoint (HF converts nothing else): a linear that is
        # not in modules_to_not_convert is unquantized, not an error.
        dense = ReplicatedLinear(64, 64, prefix="model.layers.0.mlp.dense")
        assert qc.get_quant_method(dense, "model.layers.0.mlp.dense") is None
        assert dense.weight.dtype == torch.get_default_dtype()

    def test_experts_listed_in_modules_to_not_convert_stay_unquantized(self):
        qc = Mxfp4Config.from_config({"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.0.mlp"]})
        assert not isinstance(_moe_layer(qc, 4, 64, 64, top_k=2).quant_method, Mxfp4MoEMethod)

    def test_malformed_modules_to_not_convert_is_an_error(self):
        with pytest.raises(ValueError, match="modules_to_not_convert must be a list"):
            Mxfp4Config.from_config({"quant_method": "mxfp4", "modules_to_not_convert": "lm_head"})


# ---------------------------------------------------------------------------------------------
# loading


def _moe_layer(qc, num_experts, hidden, inter, top_k, *, has_bias=True, limit=1.0, dtype=torch.float32):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return FusedMoE(num_experts, hidden, inter, MoERouting(top_k=top_k, renormalize=True), PREFIX, qc,
                        activation="swigluoai", swiglu_limit=limit, has_bias=has_bias, gate_up_interleaved=True)
    finally:
        torch.set_default_dtype(old)


def _checkpoint(gen, num_experts, hidden, inter, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """GPT-OSS expert tensors as the checkpoints hold them (gate/up rows interleaved)."""
    gu_blocks, gu_scales = random_mx(gen, num_experts, 2 * inter, hidden)
    d_blocks, d_scales = random_mx(gen, num_experts, hidden, inter)
    return {"gate_up_proj_blocks": gu_blocks, "gate_up_proj_scales": gu_scales,
            "gate_up_proj_bias": torch.randn(num_experts, 2 * inter, generator=gen).to(dtype) * 0.1,
            "down_proj_blocks": d_blocks, "down_proj_scales": d_scales,
            "down_proj_bias": torch.randn(num_experts, hidden, generator=gen).to(dtype) * 0.1}


class _Holder(nn.Module):
    """The smallest model the real loader takes: `model.layers.0.mlp.experts` plus the rules."""

    def __init__(self, experts: FusedMoE):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([nn.Module()])
        self.model.layers[0].mlp = nn.Module()
        self.model.layers[0].mlp.experts = experts
        self.config = SimpleNamespace()
        self.expert_params_mapping = mxfp4_expert_params_mapping("experts")


def _load(layer: FusedMoE, tensors: dict[str, torch.Tensor], tmp_path) -> None:
    from atom_core.loader.weights import load_weights

    save_file({f"{PREFIX}.{k}": v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    load_weights(_Holder(layer), tmp_path)


def _hf_experts(tensors, num_experts, hidden, inter, limit, dtype):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=num_experts,
                       num_experts_per_tok=2, swiglu_limit=limit)
    cfg._experts_implementation = "eager"
    experts = GptOssExperts(cfg).to(dtype)
    with torch.no_grad():
        experts.gate_up_proj.copy_(hf_dequantize(tensors["gate_up_proj_blocks"], tensors["gate_up_proj_scales"], dtype))
        experts.down_proj.copy_(hf_dequantize(tensors["down_proj_blocks"], tensors["down_proj_scales"], dtype))
        experts.gate_up_proj_bias.copy_(tensors["gate_up_proj_bias"])
        experts.down_proj_bias.copy_(tensors["down_proj_bias"])
    return experts


def _route(gen, num_tokens, num_experts, top_k):
    return moe_ref.moe_route(torch.randn(num_tokens, num_experts, generator=gen), top_k, renormalize=True)


class TestLoader:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_loaded_layer_equals_hf_gpt_oss_experts(self, dtype, tmp_path):
        e, h, i, k, limit = 4, 64, 96, 2, 1.0
        gen = seeded("hf", dtype)
        tensors = _checkpoint(gen, e, h, i, dtype)
        layer = _moe_layer(Mxfp4Config.from_config(GPT_OSS_QC), e, h, i, k, limit=limit, dtype=dtype)
        _load(layer, tensors, tmp_path)
        x = torch.randn(6, h, generator=gen).to(dtype)
        weights, ids = _route(gen, 6, e, k)
        out = layer.quant_method.apply(layer, x, weights, ids, activation="swigluoai", swiglu_limit=limit)
        ref = _hf_experts(tensors, e, h, i, limit, dtype)(x, ids.long(), weights.to(dtype))
        # float32: the same arithmetic up to summation order. bf16: HF adds the bias after rounding
        # the matmul and sums the K experts in bf16; we fuse the bias and sum in float32.
        assert rel_err(out, ref) < (1e-6 if dtype == torch.float32 else 2e-2)

    def test_gate_and_up_rows_are_deinterleaved(self, tmp_path):
        e, h, i = 2, 64, 64
        tensors = _checkpoint(seeded("rows"), e, h, i)
        layer = _moe_layer(Mxfp4Config.from_config(GPT_OSS_QC), e, h, i, 1)
        _load(layer, tensors, tmp_path)
        gu = tensors["gate_up_proj_blocks"].flatten(-2)
        assert torch.equal(layer.w13_weight[:, :i], gu[:, 0::2]) and torch.equal(layer.w13_weight[:, i:], gu[:, 1::2])
        scales = layer.w13_weight_scale.view(torch.uint8)
        assert torch.equal(scales[:, i:], tensors["gate_up_proj_scales"][:, 1::2])
        assert torch.equal(layer.w13_bias[:, :i], tensors["gate_up_proj_bias"][:, 0::2])
        assert torch.equal(layer.w2_weight, tensors["down_proj_blocks"].flatten(-2))

    def test_tensor_parallel_slices_sum_to_the_full_layer(self, tmp_path, monkeypatch):
        e, h, i, k, tp = 4, 64, 128, 2, 2
        gen = seeded("tp")
        tensors = _checkpoint(gen, e, h, i)
        qc = Mxfp4Config.from_config(GPT_OSS_QC)
        full = _moe_layer(qc, e, h, i, k)
        _load(full, tensors, tmp_path)
        x = torch.randn(5, h, generator=gen)
        weights, ids = _route(gen, 5, e, k)
        expected = full.quant_method.apply(full, x, weights, ids, activation="swigluoai", swiglu_limit=1.0)
        total = torch.zeros_like(expected)
        for rank in range(tp):
            monkeypatch.setitem(parallel_state._GROUPS, "tp", parallel_state.GroupCoordinator(
                "tp", tuple(range(tp)), rank, None, None))
            layer = _moe_layer(qc, e, h, i, k)
            _load(layer, tensors, tmp_path)
            part = i // tp
            rows = torch.cat([torch.arange(rank * part, (rank + 1) * part),
                              i + torch.arange(rank * part, (rank + 1) * part)])
            assert torch.equal(layer.w13_weight, full.w13_weight[:, rows])
            assert torch.equal(layer.w2_weight, full.w2_weight[:, :, rank * part // 2:(rank + 1) * part // 2])
            assert torch.equal(layer.w2_bias, full.w2_bias if rank == 0 else torch.zeros_like(full.w2_bias))
            total += layer.quant_method.apply(layer, x, weights, ids, activation="swigluoai", swiglu_limit=1.0)
        assert rel_err(total, expected) < 1e-6

    def test_expert_parallel_ranks_hold_whole_experts(self, tmp_path, monkeypatch):
        e, h, i = 4, 64, 64
        tensors = _checkpoint(seeded("ep"), e, h, i)
        qc = Mxfp4Config.from_config(GPT_OSS_QC)
        full = _moe_layer(qc, e, h, i, 2)
        _load(full, tensors, tmp_path)
        monkeypatch.setitem(parallel_state._GROUPS, "tp", parallel_state.GroupCoordinator("tp", (0, 1), 1, None, None))
        set_expert_parallel(True)
        try:
            layer = _moe_layer(qc, e, h, i, 2)
        finally:
            set_expert_parallel(False)
        _load(layer, tensors, tmp_path)
        for name in ("w13_weight", "w13_weight_scale", "w13_bias", "w2_weight", "w2_weight_scale", "w2_bias"):
            mine, ref = getattr(layer, name), getattr(full, name)[2:]
            assert torch.equal(mine.view(torch.uint8) if mine.dtype == torch.float8_e8m0fnu else mine,
                               ref.view(torch.uint8) if ref.dtype == torch.float8_e8m0fnu else ref), name

    def test_split_inside_a_scale_group_is_refused(self, monkeypatch):
        monkeypatch.setitem(parallel_state._GROUPS, "tp", parallel_state.GroupCoordinator("tp", (0, 1), 0, None, None))
        with pytest.raises(ValueError, match="multiple of 32.*enable_expert_parallel"):
            _moe_layer(Mxfp4Config.from_config(GPT_OSS_QC), 4, 64, 96, 2)  # 48 per rank

    def test_per_expert_tensors_and_wrong_shapes_are_errors(self):
        layer = _moe_layer(Mxfp4Config.from_config(GPT_OSS_QC), 2, 64, 64, 1)
        blocks = layer.w13_weight
        with pytest.raises(ValueError, match="not per expert"):
            blocks.weight_loader(blocks, torch.zeros(128, 2, 16, dtype=torch.uint8), shard_id="w1", expert_id=0)
        with pytest.raises(ValueError, match="expected \\[2, 128, 2\\]"):
            blocks.weight_loader(blocks, torch.zeros(2, 128, 4, 16, dtype=torch.uint8))

    def test_dummy_weights_are_finite_and_small(self):
        from atom_core.loader.weights import init_dummy_weights

        layer = _moe_layer(Mxfp4Config.from_config(GPT_OSS_QC), 4, 64, 64, 2, dtype=torch.bfloat16)
        init_dummy_weights(layer, seed=0)
        w = dequantize_mxfp4(layer.w13_weight, layer.w13_weight_scale, torch.float32)
        assert w.isfinite().all() and 0 < w.abs().max() < 0.1
        gen = seeded("dummy")
        weights, ids = _route(gen, 3, 4, 2)
        out = layer.quant_method.apply(layer, torch.randn(3, 64, generator=gen).bfloat16(), weights, ids,
                                       activation="swigluoai", swiglu_limit=1.0)
        assert out.isfinite().all()


# ---------------------------------------------------------------------------------------------
# reference and Triton kernel


def _kernel_inputs(key, e, h, i, t, k, dtype, device, has_bias=True, drop=False):
    gen = seeded(*key)
    w13, s13 = random_mx(gen, e, 2 * i, h)
    w2, s2 = random_mx(gen, e, h, i)
    x = torch.randn(t, h, generator=gen).to(dtype)
    weights, ids = _route(gen, t, e, k)
    if drop:  # ids of experts on another rank (EP): no contribution
        ids[::2, 0] = -1
        ids[1::3, -1] = e
    b13 = (torch.randn(e, 2 * i, generator=gen) * 0.1).to(dtype) if has_bias else None
    b2 = (torch.randn(e, h, generator=gen) * 0.1).to(dtype) if has_bias else None
    args = (x, w13.flatten(-2), s13, w2.flatten(-2), s2, weights, ids)
    move = (lambda v: v.to(device) if isinstance(v, torch.Tensor) else v)
    return [move(a) for a in args], move(b13), move(b2)


class TestReference:
    @pytest.mark.parametrize("activation,limit", [("silu", None), ("swigluoai", 1.0)])
    def test_equals_hf_dequantization_then_the_moe_reference(self, activation, limit):
        (x, w13, s13, w2, s2, weights, ids), b13, b2 = _kernel_inputs(("ref", activation), 8, 64, 96, 7, 2,
                                                                      torch.bfloat16, "cpu", drop=True)
        e, rows = w13.shape[:2]
        w13_d = hf_dequantize(w13.view(e, rows, -1, 16), s13, torch.bfloat16).transpose(1, 2)
        w2_d = hf_dequantize(w2.view(e, w2.shape[1], -1, 16), s2, torch.bfloat16).transpose(1, 2)
        ref = moe_ref.fused_moe(x, w13_d, w2_d, weights, ids, activation=activation, w13_bias=b13, w2_bias=b2,
                                swiglu_limit=limit)
        out = fused_moe_mxfp4_ref(x, w13, s13, w2, s2, weights, ids, activation, b13, b2, limit)
        assert torch.equal(out, ref)


# (E, H, I, T, top_k): small ones in both activations and dtypes (interpreter and GPU); on the GPU
# also GPT-OSS-20b at M = 1, 7, 64, 300 and -120b in its own configuration (swigluoai, biases, bf16),
# and one other shape in silu without biases
SMALL_SHAPES = [(4, 64, 96, 5, 2), (8, 96, 64, 1, 2), (3, 160, 32, 9, 3)]
GPU_CASES = [((32, 2880, 2880, m, 4), "swigluoai") for m in (1, 7, 64, 300)] + [
    ((128, 2880, 2880, 3, 4), "swigluoai"), ((8, 4096, 1408, 33, 2), "silu")]


class TestTritonMoe:
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
    def test_decode_equals_hf_dequantization_bits(self, device, dtype):
        from atom_core.kernels.triton.moe_mxfp4 import dequantize_mxfp4 as triton_dequantize

        gen = seeded("tdq", dtype)
        blocks = torch.randint(0, 256, (1, 24, 10, 16), dtype=torch.uint8, generator=gen)
        scales = torch.arange(24 * 10).remainder(256).to(torch.uint8).reshape(1, 24, 10)
        ref = hf_dequantize(blocks, scales, dtype)[0].t()
        out = triton_dequantize(blocks[0].flatten(-2).to(device), scales[0].to(device), dtype).cpu()
        if device == "cpu":  # the interpreter rounds float32 -> bf16 by truncation: subnormal results differ
            kept = ref.float().abs() >= torch.finfo(dtype).tiny
        elif dtype == torch.bfloat16:  # the inline-PTX decode is exact for exponents 65..191 (moe_mxfp4.PTX_SHIFT)
            exponent = scales[0].repeat_interleave(32, 1)  # [rows, K], as ref
            kept = (exponent >= 65) & (exponent <= 191)
        else:
            kept = torch.ones_like(ref, dtype=torch.bool)
        assert kept.sum() > ref.numel() // 3
        nan = ref.isnan()  # 0 * 2^128 (exponent 255): NaN both ways, its bits are the platform's
        assert torch.equal(out.isnan() & kept, nan & kept)
        kept &= ~nan
        assert torch.equal(bits(out[kept]), bits(ref[kept]))

    @pytest.mark.parametrize("shape", SMALL_SHAPES)
    @pytest.mark.parametrize("activation,limit,has_bias", [("silu", None, False), ("swigluoai", 1.0, True)])
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    # `auto` picks the tiled or the GEMV path (TestPathChoice); the interpreter runs each kernel path once
    @pytest.mark.parametrize("path", ["tiled"] if INTERPRET else ["auto", "tiled"])
    def test_matches_reference(self, device, shape, activation, limit, has_bias, dtype, path):
        """bf16 runs the inline-PTX decode on NVIDIA GPUs, fp16 the portable one. These shapes
        have T * top_k <= 32: "auto" runs the GEMV path, "tiled" forces the tl.dot kernels."""
        from atom_core.kernels.triton.moe_mxfp4 import fused_moe_mxfp4

        e, h, i, t, k = shape
        args, b13, b2 = _kernel_inputs(("moe", shape, activation), e, h, i, t, k, dtype, device, has_bias)
        out = fused_moe_mxfp4(*args, activation, b13, b2, limit, path=path)
        ref = fused_moe_mxfp4_ref(*args, activation, b13, b2, limit)
        assert rel_err(out, ref) < TOL[dtype]

    @pytest.mark.gpu
    @pytest.mark.parametrize("shape,activation", GPU_CASES)
    def test_model_shapes_match_reference_on_cuda(self, shape, activation):
        from atom_core.kernels.triton.moe_mxfp4 import fused_moe_mxfp4

        if not torch.cuda.is_available():
            pytest.skip("needs CUDA")
        e, h, i, t, k = shape
        swiglu = activation == "swigluoai"
        args, b13, b2 = _kernel_inputs(("gpu", shape), e, h, i, t, k, torch.bfloat16, "cuda", has_bias=swiglu)
        limit = 7.0 if swiglu else None
        out = fused_moe_mxfp4(*args, activation, b13, b2, limit)
        ref = fused_moe_mxfp4_ref(*args, activation, b13, b2, limit)
        assert rel_err(out, ref) < TOL[torch.bfloat16]

    @pytest.mark.gpu
    def test_replays_in_a_cuda_graph(self):
        """No host sync: a captured call replays to the eager result on new inputs."""
        from atom_core.kernels.triton.moe_mxfp4 import fused_moe_mxfp4

        if not torch.cuda.is_available():
            pytest.skip("needs CUDA")
        e, h, i, t, k = 32, 2880, 2880, 4, 4
        args, b13, b2 = _kernel_inputs(("graph",), e, h, i, t, k, torch.bfloat16, "cuda")
        x, ids = args[0], args[6]
        run = lambda: fused_moe_mxfp4(*args, "swigluoai", b13, b2, 7.0)  # noqa: E731
        run()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        x.copy_(torch.randn_like(x))
        ids.copy_(torch.randperm(e, device="cuda")[:t * k].view(t, k).to(torch.int32))
        graph.replay()
        assert torch.equal(out, run())

    @pytest.mark.parametrize("tier_tokens", [1, 24, 96, 400])
    def test_every_default_tile_tier_and_dropped_ids(self, device, tier_tokens):
        """Each tier of default_mxfp4_config (by rows per expert), forced on a small float32 problem
        with K tails (H, I not multiples of BLOCK_K) and ids outside [0, E)."""
        from atom_core.kernels.triton.moe_mxfp4 import default_mxfp4_config, fused_moe_mxfp4

        cfg = default_mxfp4_config(tier_tokens, 4, 8)
        args, b13, b2 = _kernel_inputs(("tier", tier_tokens), 8, 96, 160, 6, 2, torch.float32, device, drop=True)
        out = fused_moe_mxfp4(*args, "swigluoai", b13, b2, 1.0, config=cfg)
        ref = fused_moe_mxfp4_ref(*args, "swigluoai", b13, b2, 1.0)
        assert rel_err(out, ref) < TOL[torch.float32]

    def test_bad_arguments_are_clear_errors(self):
        from atom_core.kernels.triton.moe_mxfp4 import fused_moe_mxfp4

        (x, w13, s13, w2, s2, weights, ids), _, _ = _kernel_inputs(("bad",), 2, 64, 64, 2, 1, torch.float32, "cpu")
        with pytest.raises(ValueError, match="w13 must be uint8"):
            fused_moe_mxfp4(x, w13.view(torch.int8), s13, w2, s2, weights, ids)
        with pytest.raises(ValueError, match="w2_scale must be"):
            fused_moe_mxfp4(x, w13, s13, w2, s2[:, :32], weights, ids)
        with pytest.raises(ValueError, match="swiglu_limit"):
            fused_moe_mxfp4(x, w13, s13, w2, s2, weights, ids, "swigluoai")


GEMV_SHAPES = [(4, 64, 96, 1, 1), (8, 96, 64, 2, 2), (3, 160, 32, 3, 3), (6, 64, 64, 2, 4)]
ACTIVATIONS = [("silu", None, False), ("swigluoai", 1.0, True)]
# H and I one 32-wide group past one BLOCK_K of the GEMV each reduces over: two K blocks in both GEMVs,
# the second a tail (the prefetch of a next block, and of one past the end, in both)
TWO_K_BLOCKS = (5, GEMV1_TILE[1] + 32, GEMV2_TILE[1] + 32, 1, 4)


class TestGemvPath:
    """The decode path (moe_mxfp4_decode): per-assignment GEMVs, no alignment, top-k sum fused."""

    # (E, H, I, T, top_k): T 1..2 (test_dropped_and_duplicate_ids: 4), top_k 1..4 (3: a padded slot),
    # K tails (H or I not a multiple of BLOCK_K); TWO_K_BLOCKS in both activations on the GPU, in
    # swigluoai (biases, the clamp) interpreted
    CASES = [(shape, *act) for shape in GEMV_SHAPES for act in ACTIVATIONS] + [
        (TWO_K_BLOCKS, *act) for act in ACTIVATIONS[1 if INTERPRET else 0:]]

    @pytest.mark.parametrize("shape,activation,limit,has_bias", CASES)
    def test_matches_reference(self, device, shape, activation, limit, has_bias):
        from atom_core.kernels.triton.moe_mxfp4 import fused_moe_mxfp4

        e, h, i, t, k = shape
        args, b13, b2 = _kernel_inputs(("gemv", shape, activation), e, h, i, t, k, torch.bfloat16, device, has_bias)
        out = fused_moe_mxfp4(*args, activation, b13, b2, limit, path="gemv")
        ref = fused_moe_mxfp4_ref(*args, activation, b13, b2, limit)
        assert rel_err(out, ref) < TOL[torch.bfloat16]

    @pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
    def test_other_dtypes_match_reference(self, device, dtype):
        from atom_core.kernels.triton.moe_mxfp4 import fused_moe_mxfp4

        args, b13, b2 = _kernel_inputs(("gemv-dtype", dtype), 4, 96, 64, 3, 2, dtype, device)
        out = fused_moe_mxfp4(*args, "swigluoai", b13, b2, 1.0, path="gemv")
        ref = fused_moe_mxfp4_ref(*args, "swigluoai", b13, b2, 1.0)
        assert rel_err(out, ref) < TOL[dtype]

    @pytest.mark.parametrize("top_k", [2, 3])
    def test_dropped_and_duplicate_ids(self, device, top_k):
        """Ids outside [0, E) (experts of other EP ranks) add nothing, whole tokens may have none;
        one expert twice in a token's list counts twice."""
        from atom_core.kernels.triton.moe_mxfp4 import fused_moe_mxfp4

        args, b13, b2 = _kernel_inputs(("gemv-drop", top_k), 6, 96, 64, 4, top_k, torch.float32, device, drop=True)
        ids = args[6]
        ids[1, 1] = ids[1, 0] = 2
        ids[3, :] = -1
        out = fused_moe_mxfp4(*args, "swigluoai", b13, b2, 1.0, path="gemv")
        ref = fused_moe_mxfp4_ref(*args, "swigluoai", b13, b2, 1.0)
        assert torch.equal(out[3].cpu(), torch.zeros_like(out[3].cpu()))
        assert rel_err(out, ref) < TOL[torch.float32]

    @pytest.mark.gpu
    @pytest.mark.parametrize("experts", [32, 128])  # gpt-oss-20b, -120b
    @pytest.mark.parametrize("num_tokens", [1, 7])
    def test_model_shapes_match_reference_and_the_tiled_path(self, experts, num_tokens):
        from atom_core.kernels.triton.moe_mxfp4 import fused_moe_mxfp4

        if not torch.cuda.is_available():
            pytest.skip("needs CUDA")
        args, b13, b2 = _kernel_inputs(("gemv-gpu", experts, num_tokens), experts, 2880, 2880, num_tokens, 4,
                                       torch.bfloat16, "cuda")
        out = fused_moe_mxfp4(*args, "swigluoai", b13, b2, 7.0, path="gemv")
        ref = fused_moe_mxfp4_ref(*args, "swigluoai", b13, b2, 7.0)
        tiled = fused_moe_mxfp4(*args, "swigluoai", b13, b2, 7.0, path="tiled")
        assert rel_err(out, ref) < TOL[torch.bfloat16]
        assert rel_err(out, tiled) < TOL[torch.bfloat16]

    @pytest.mark.gpu
    def test_replays_in_a_cuda_graph(self):
        """No host sync and a grid from host ints: a captured decode call replays to the eager
        result on new activations and new routing (incl. a dropped id)."""
        from atom_core.kernels.triton.moe_mxfp4 import fused_moe_mxfp4, select_path

        if not torch.cuda.is_available():
            pytest.skip("needs CUDA")
        e, h, i, t, k = 32, 2880, 2880, 2, 4
        assert select_path(t, k) == "gemv"
        args, b13, b2 = _kernel_inputs(("gemv-graph",), e, h, i, t, k, torch.bfloat16, "cuda")
        x, ids = args[0], args[6]
        run = lambda: fused_moe_mxfp4(*args, "swigluoai", b13, b2, 7.0)  # noqa: E731
        run()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        x.copy_(torch.randn_like(x))
        ids.copy_(torch.randperm(e, device="cuda")[:t * k].view(t, k).to(torch.int32))
        ids[1, 2] = -1
        graph.replay()
        assert torch.equal(out, run())
        assert rel_err(out, fused_moe_mxfp4_ref(*args, "swigluoai", b13, b2, 7.0)) < TOL[torch.bfloat16]


@pytest.mark.skipif(INTERPRET, reason="the interpreter replaces the compiled kernels")
def test_gemv_kernels_compile_for_hopper_without_spills():
    """Both decode GEMVs compile for sm_90 with Triton's bundled ptxas (no GPU needed) at
    gpt-oss's shapes and the default tiles, with no local-memory spills."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from atom_core.kernels.triton import moe_mxfp4_decode as dec

    def compile_(fn, sig, consts, **options):
        src = ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in consts}}, constexprs=consts)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)

    ints = lambda *names: {n: "i32" for n in names}  # noqa: E731
    (bn1, bk1, warps1), (bn2, bk2) = dec.GEMV1_TILE, dec.GEMV2_TILE
    k1 = compile_(dec._gemv1_kernel, {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8", "bias_ptr": "*bf16",
                                      "ids_ptr": "*i32", "act_ptr": "*fp32", **ints("num_assignments", "num_experts"),
                                      "limit": "fp32", **ints("stride_xt", "stride_we", "stride_se", "stride_sg",
                                                              "stride_be", "stride_at")},
                  {"stride_wn": 360, "stride_sn": 90, "INTER": 2880, "HIDDEN": 2880, "TOP_K": 4, "ACTIVATION": 1,
                   "HAS_BIAS": True, "BLOCK_N": bn1, "BLOCK_K": bk1}, num_warps=warps1, num_stages=1)
    k2 = compile_(dec._gemv2_kernel, {"act_ptr": "*fp32", "w_ptr": "*u8", "s_ptr": "*u8", "bias_ptr": "*bf16",
                                      "topk_weights_ptr": "*fp32", "ids_ptr": "*i32", "out_ptr": "*bf16",
                                      **ints("num_tokens", "num_experts", "stride_at", "stride_we", "stride_se",
                                             "stride_sg", "stride_be", "stride_ot")},
                  {"stride_wn": 360, "stride_sn": 90, "HIDDEN": 2880, "INTER": 2880, "TOP_K": 4, "K_P": 4,
                   "HAS_BIAS": True, "BLOCK_N": bn2, "BLOCK_K": bk2}, num_warps=4, num_stages=1)
    import os
    import re
    import subprocess
    import tempfile

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        pytest.skip("Triton ships no cuobjdump here")
    for kernel in (k1, k2):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        regs, stack = int(re.search(r"REG:(\d+)", usage).group(1)), int(re.search(r"STACK:(\d+)", usage).group(1))
        assert stack == 0 and regs <= 128, usage


class TestPathChoice:
    def test_decode_batches_take_the_gemv_path_and_larger_ones_the_tiled(self):
        from atom_core.kernels.triton.moe_mxfp4 import default_mxfp4_config, select_path
        from atom_core.kernels.triton.moe_mxfp4_decode import GEMV_MAX_ASSIGNMENTS

        assert GEMV_MAX_ASSIGNMENTS == 32
        assert [select_path(t, 4) for t in (1, 7, 8, 9, 64)] == ["gemv"] * 3 + ["tiled"] * 2
        assert select_path(32, 1) == "gemv" and select_path(33, 1) == "tiled"
        assert select_path(1, 4, default_mxfp4_config(1, 4, 32)) == "tiled"  # an explicit tile config
        assert select_path(64, 4, path="gemv") == "gemv" and select_path(1, 4, path="tiled") == "tiled"
        with pytest.raises(ValueError, match="unknown MXFP4 MoE path 'fast'"):
            select_path(1, 4, path="fast")

    @pytest.mark.parametrize("num_tokens,expected", [(1, "gemv"), (8, "gemv"), (9, "tiled")])
    def test_fused_moe_mxfp4_dispatches_by_assignments(self, monkeypatch, num_tokens, expected):
        """What fused_moe_mxfp4 runs (kernels replaced by recorders, so no GPU or interpreter)."""
        from atom_core.kernels.triton import moe_mxfp4

        ran = []

        class TiledRan(Exception):
            pass

        def gemv(*args):
            ran.append("gemv")
            return args[-1]

        def align(*args):
            ran.append("tiled")
            raise TiledRan

        monkeypatch.setattr(moe_mxfp4, "fused_moe_mxfp4_gemv", gemv)
        monkeypatch.setattr(moe_mxfp4, "moe_align_block_size", align)
        args, b13, b2 = _kernel_inputs(("dispatch", num_tokens), 4, 64, 64, num_tokens, 4, torch.bfloat16, "cpu")
        try:
            moe_mxfp4.fused_moe_mxfp4(*args, "swigluoai", b13, b2, 1.0)
        except TiledRan:
            pass
        assert ran == [expected]
