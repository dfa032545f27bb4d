"""The decode path of the unquantized fused MoE (kernels/triton/moe_decode.py: two GEMVs for
T * top_k <= 32) against the torch reference, and how `launch_fused_moe` chooses it.

`cpu` cases run the kernels under Triton's interpreter (tiny shapes), `cuda` cases (marker `gpu`)
at Qwen3-30B-A3B, DeepSeek-V2-Lite, Mixtral and gpt-oss-20b (bf16) expert shapes; the sm_90 check
compiles both kernels offline (no GPU) and requires no register spills:
    TRITON_INTERPRET=1 python -m pytest tests/kernels/test_moe_decode.py -q
    python -m pytest -m gpu tests/kernels/test_moe_decode.py -q
"""
from __future__ import annotations

import re
import zlib

import pytest
import torch

triton = pytest.importorskip("triton")

from atom_core.kernels import moe_ref  # noqa: E402
from atom_core.kernels.triton import moe as tm  # noqa: E402
from atom_core.kernels.triton import moe_decode as dec  # noqa: E402
from tests.kernels.tolerances import INTERPRET, TOL, rel_err  # noqa: E402

SMALL_TILES = dec.GemvTiles((4, 32, 1), (2, 32))  # several K steps with a tail, several row blocks with a tail


def make_inputs(key, num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype,
                device: str, bias: bool = False) -> dict:
    """Fresh random inputs (seeded by `key`, made on `device`), routed by the reference router; weights
    scaled by fan-in."""
    gen = torch.Generator(device=device).manual_seed(zlib.crc32(repr(key).encode()))
    randn = lambda *shape: torch.randn(*shape, generator=gen, device=device)  # noqa: E731
    weights, ids = moe_ref.moe_route(randn(num_tokens, num_experts), top_k, renormalize=True)
    args = dict(hidden=randn(num_tokens, hidden), w13=randn(num_experts, 2 * inter, hidden) * hidden ** -0.5,
                w2=randn(num_experts, hidden, inter) * inter ** -0.5, topk_weights=weights, topk_ids=ids,
                w13_bias=randn(num_experts, 2 * inter) if bias else None,
                w2_bias=randn(num_experts, hidden) if bias else None)
    cast = lambda name, t: t if name.startswith("topk") else t.to(dtype)  # noqa: E731  (routing stays as routed)
    return {name: None if t is None else cast(name, t) for name, t in args.items()}


ACTIVATIONS = [("silu", None, False), ("swigluoai", 1.0, True)]  # (activation, swiglu_limit, biases)


def gemv(args: dict, activation: str = "silu", limit: float | None = None, tiles=None) -> torch.Tensor:
    if tiles is None:
        return tm.launch_fused_moe(**args, activation=activation, swiglu_limit=limit, path="gemv")
    tm._check_moe_args(args["hidden"], args["w13"], args["w2"], args["topk_weights"], args["topk_ids"], activation,
                       args["w13_bias"], args["w2_bias"], limit)
    out = torch.full_like(args["hidden"], float("nan"))
    return dec.fused_moe_gemv(args["hidden"], args["w13"], args["w2"], args["topk_weights"], args["topk_ids"],
                              activation, args["w13_bias"], args["w2_bias"], limit, out, tiles)


def reference(args: dict, activation: str = "silu", limit: float | None = None) -> torch.Tensor:
    return moe_ref.fused_moe(**args, activation=activation, swiglu_limit=limit)


class TestGemvKernels:
    # (T, E, top_k): T 1..4, top_k 1/2/6/8, up to the T * top_k = 32 bound
    ROUTES = [(1, 4, 1), (3, 5, 2), (2, 8, 6), (4, 10, 8), (4, 7, 6)]

    @pytest.mark.parametrize("route", ROUTES, ids=lambda r: "T{}-E{}-K{}".format(*r))
    @pytest.mark.parametrize("activation,limit,bias", ACTIVATIONS, ids=["silu", "swigluoai-bias"])
    def test_matches_reference_bf16(self, device, route, activation, limit, bias):
        """H = 74 and I = 42 are multiples of no tile: K tails and clamped rows in both GEMVs."""
        t, e, k = route
        args = make_inputs(("bf16", route, activation), t, e, k, 74, 42, torch.bfloat16, device, bias)
        ref = reference(args, activation, limit)
        assert rel_err(gemv(args, activation, limit), ref) < TOL[torch.bfloat16]
        if t * k <= 12:  # the interpreter's time grows with the programs: small tiles on the small routes
            assert rel_err(gemv(args, activation, limit, SMALL_TILES), ref) < TOL[torch.bfloat16]

    @pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
    @pytest.mark.parametrize("activation,limit,bias", ACTIVATIONS, ids=["silu", "swigluoai-bias"])
    def test_matches_reference_other_dtypes(self, device, dtype, activation, limit, bias):
        args = make_inputs(("dtype", str(dtype), activation), 3, 6, 2, 40, 24, dtype, device, bias)
        ref = reference(args, activation, limit)
        assert rel_err(gemv(args, activation, limit), ref) < TOL[dtype]
        assert rel_err(gemv(args, activation, limit, SMALL_TILES), ref) < TOL[dtype]

    def test_expert_map_drops_missing_and_zero_weighted_experts(self, device):
        """An expert-parallel rank's view: ids outside [0, E) and FusedMoE's foreign slots (mapped to
        local 0, weight 0) add nothing; a token with no expert here gets exact zeros; one expert twice
        in a token's list counts twice. Expert 0's weights are NaN: a zero-weighted slot reads none."""
        args = make_inputs("ep", 4, 5, 3, 40, 24, torch.float32, device)
        ids, weights = args["topk_ids"], args["topk_weights"]
        ids[0, 1], ids[1, 2] = -1, 5  # dropped
        ids[2, 0], weights[2, 0] = 0, 0.0  # foreign, as FusedMoE maps it
        ids[3, :], weights[3, :] = 0, 0.0  # no expert of this rank
        ids[1, 0] = ids[1, 1] = 3  # duplicate
        ids[0, 0] = ids[0, 2] = ids[2, 1] = ids[2, 2] = 4  # expert 0 has only zero-weighted slots
        args["w13"][0] = float("nan")
        args["w2"][0] = float("nan")
        out = gemv(args, tiles=SMALL_TILES)
        clean = dict(args, w13=args["w13"].clone(), w2=args["w2"].clone())
        clean["w13"][0] = clean["w2"][0] = 0.0
        assert torch.equal(out[3].cpu(), torch.zeros(40))
        assert rel_err(out, reference(clean)) < TOL[torch.float32]

    def test_tensor_parallel_slices_sum_to_the_full_layer(self, device):
        """FusedMoE under TP: each rank holds every expert's slice of I (21 of 42 here: no tile multiple)
        and w2_bias on rank 0 only; the ranks' outputs sum (the all_reduce) to the full layer."""
        args = make_inputs("tp", 3, 5, 2, 40, 42, torch.float32, device, bias=True)
        inter, half = 42, 21
        total = torch.zeros_like(args["hidden"])
        for rank in range(2):
            own = torch.arange(rank * half, (rank + 1) * half, device=device)
            rows = torch.cat([own, inter + own])  # this rank's gate rows, then its up rows
            shard = dict(args, w13=args["w13"][:, rows].contiguous(), w13_bias=args["w13_bias"][:, rows].contiguous(),
                         w2=args["w2"][:, :, own].contiguous(),
                         w2_bias=args["w2_bias"] if rank == 0 else torch.zeros_like(args["w2_bias"]))
            total += gemv(shard, "swigluoai", 1.0, SMALL_TILES)
        assert rel_err(total, reference(args, "swigluoai", 1.0)) < TOL[torch.float32]

    def test_deterministic_and_int64_ids(self, device):
        args = make_inputs("det", 2, 6, 6, 40, 24, torch.bfloat16, device)
        out = gemv(args, tiles=SMALL_TILES)
        assert torch.equal(out, gemv(args, tiles=SMALL_TILES))
        assert torch.equal(out, gemv(dict(args, topk_ids=args["topk_ids"].long()), tiles=SMALL_TILES))  # torch.topk's


class TestExpertParallelLayer:
    def test_fused_moe_layer_on_an_ep_rank_takes_the_gemv_path(self, device, monkeypatch):
        """FusedMoE under EP (rank 1 of 2, ops = the Triton provider, decode path gemv): its output
        (before the all_reduce) is the reference over this rank's experts only."""
        from atom_core.distributed import parallel_state, set_expert_parallel
        from atom_core.kernels import triton as triton_ops
        from atom_core.model_ops import moe as moe_layer
        from atom_core.model_ops.moe import FusedMoE, MoERouting

        if device == "cuda" and not torch.cuda.is_available():
            pytest.skip("needs CUDA")
        e, h, i, k = 6, 40, 24, 3
        monkeypatch.setitem(parallel_state._GROUPS, "tp", parallel_state.GroupCoordinator("tp", (0, 1), 1, None, None))
        monkeypatch.setattr(moe_layer, "all_reduce", lambda t: t)  # this rank's partial sum
        set_expert_parallel(True)
        try:
            with torch.device(device):
                layer = FusedMoE(e, h, i, MoERouting(top_k=k, renormalize=True), "experts")
        finally:
            set_expert_parallel(False)
        full = make_inputs("ep-layer", 2, e, k, h, i, torch.float32, device)
        with torch.no_grad():
            layer.w13_weight.data = full["w13"][3:].clone()
            layer.w2_weight.data = full["w2"][3:].clone()
        layer.ops = triton_ops
        logits = torch.randn(2, e, generator=torch.Generator().manual_seed(5)).to(device)
        weights, ids = moe_ref.moe_route(logits, k, renormalize=True)
        ids = torch.where(ids >= 3, ids, -1).to(torch.int32)  # other ranks' experts add nothing here
        ran, real_gemv = [], dec.fused_moe_gemv
        monkeypatch.setattr(dec, "fused_moe_gemv", lambda *a: ran.append(1) or real_gemv(*a))
        out = layer.route_and_run(full["hidden"], logits, None)
        assert ran == [1]
        expected = moe_ref.fused_moe(full["hidden"], full["w13"], full["w2"], weights, ids)
        assert rel_err(out, expected) < TOL[torch.float32]


# (H, I, top_k, activation code, biases): the bf16 expert shapes the GPU tests run
MODEL_SHAPES = {
    "qwen3-30b-a3b": (2048, 768, 8, 0, False),
    "deepseek-v2-lite": (2048, 1408, 6, 0, False),
    "mixtral-8x7b": (4096, 14336, 2, 0, False),
    "gpt-oss-20b-bf16": (2880, 2880, 4, 1, True),
}
_STRIDES1 = ("stride_xt", "stride_we", "stride_wn", "stride_be", "stride_at")
_STRIDES2 = ("stride_at", "stride_we", "stride_wn", "stride_be", "stride_ot")


def _compile_sm90(fn, sig: dict, consts: dict, num_warps: int):
    """Pointers and strides carry the 16-divisibility Triton gives them at launch (else loads stay scalar)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    aligned = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items()
               if t.startswith("*") or a.startswith("stride")}
    src = ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in consts}}, constexprs=consts, attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": 1})


@pytest.mark.skipif(INTERPRET, reason="the interpreter replaces the compiled kernels")
@pytest.mark.parametrize("shape,dtype", [(name, "bf16") for name in MODEL_SHAPES] +
                         [("deepseek-v2-lite", "fp16"), ("qwen3-30b-a3b", "fp32")])
def test_gemv_kernels_compile_for_hopper_without_spills(shape, dtype):
    """Both GEMVs at the default tiles compile for sm_90 with Triton's bundled toolchain (no GPU), stream
    the weights with 16-byte loads, convert no layout inside the K loop (a shared-memory round trip and
    a barrier a step) and spill nothing (cuobjdump STACK 0)."""
    from tests.kernels.sm90_compile import cuobjdump_path, stack_bytes

    if cuobjdump_path() is None:
        pytest.skip("Triton ships no cuobjdump here")
    hidden, inter, top_k, act, bias = MODEL_SHAPES[shape]
    tiles = dec.FP32_TILES if dtype == "fp32" else dec.DEFAULT_TILES
    (bn1, bk1, warps1), (bn2, bk2) = tiles.gemv1, tiles.gemv2
    k_p = triton.next_power_of_2(top_k)
    ptr = "*" + dtype
    sig1 = {"x_ptr": ptr, "w_ptr": ptr, "bias_ptr": ptr, "ids_ptr": "*i32", "topk_weights_ptr": "*fp32", "act_ptr": ptr,
            "num_assignments": "i32", "num_experts": "i32", "limit": "fp32", **{s: "i32" for s in _STRIDES1}}
    k1 = _compile_sm90(dec._moe_gemv1_kernel, sig1, dict(INTER=inter, HIDDEN=hidden, TOP_K=top_k, ACTIVATION=act,
                                                         HAS_BIAS=bias, BLOCK_N=bn1, BLOCK_K=bk1), warps1)
    sig2 = {"act_ptr": ptr, "w_ptr": ptr, "bias_ptr": ptr, "topk_weights_ptr": "*fp32", "ids_ptr": "*i32",
            "out_ptr": ptr, "num_tokens": "i32", "num_experts": "i32", **{s: "i32" for s in _STRIDES2}}
    consts2 = dict(HIDDEN=hidden, INTER=inter, TOP_K=top_k, K_P=k_p, HAS_BIAS=bias, BLOCK_N=bn2, BLOCK_K=bk2)
    k2 = _compile_sm90(dec._moe_gemv2_kernel, sig2, consts2, k_p)
    for name, kernel in (("gemv1", k1), ("gemv2", k2)):
        assert re.search(r"ld\.global[.\w]*\.v4", kernel.asm["ptx"]), f"{name}: weights should load 16 bytes a thread"
        ttgir = kernel.asm["ttgir"]
        loop = ttgir[ttgir.index("scf.for"):ttgir.index("scf.yield")]
        assert "convert_layout" not in loop and "local_" not in loop, f"{name}: layout conversion in the K loop"
        assert stack_bytes(kernel) == 0, f"{name} spills registers"


GPU_CASES = [("qwen3-30b-a3b", 128, 1), ("qwen3-30b-a3b", 128, 4), ("deepseek-v2-lite", 64, 1),
             ("deepseek-v2-lite", 64, 5), ("mixtral-8x7b", 8, 1), ("mixtral-8x7b", 8, 16),
             ("gpt-oss-20b-bf16", 32, 1), ("gpt-oss-20b-bf16", 32, 8)]  # (shape, E, T): T * top_k <= 32


@pytest.mark.gpu
@pytest.mark.parametrize("shape,experts,num_tokens", GPU_CASES, ids=lambda v: str(v))
def test_model_shapes_match_reference_and_the_tiled_path(shape, experts, num_tokens):
    if INTERPRET or not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    hidden, inter, top_k, act, bias = MODEL_SHAPES[shape]
    activation, limit = ("swigluoai", 7.0) if act else ("silu", None)
    args = make_inputs(("gpu", shape, num_tokens), num_tokens, experts, top_k, hidden, inter, torch.bfloat16, "cuda",
                       bias)
    out = tm.launch_fused_moe(**args, activation=activation, swiglu_limit=limit, path="gemv")
    tiled = tm.launch_fused_moe(**args, activation=activation, swiglu_limit=limit, path="tiled")
    assert rel_err(out, reference(args, activation, limit)) < TOL[torch.bfloat16]
    assert rel_err(out, tiled) < TOL[torch.bfloat16]


@pytest.mark.gpu
def test_routed_decode_replays_in_a_cuda_graph(monkeypatch):
    """moe_route + fused_moe on a decode batch (auto -> gemv), captured once: replays equal eager
    runs on new activations and new routing (skewed, and with a dropped slot), bit for bit."""
    if INTERPRET or not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    num_tokens, experts, (hidden, inter, top_k, _, _) = 2, 128, MODEL_SHAPES["qwen3-30b-a3b"]
    assert dec.select_path(num_tokens, top_k) == "gemv"
    args = make_inputs("graph", num_tokens, experts, top_k, hidden, inter, torch.bfloat16, "cuda")
    x = args["hidden"]
    logits = torch.randn(num_tokens, experts, device="cuda")
    drop = torch.zeros(num_tokens, top_k, dtype=torch.int32, device="cuda")

    def step():
        weights, ids = tm.moe_route(logits, top_k, renormalize=True)
        return tm.fused_moe(x, args["w13"], args["w2"], weights, ids - drop * (ids + 1))  # drop: id -1

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        logits.copy_(torch.randn(num_tokens, experts, device="cuda", generator=gen) * (1 + 4 * seed))
        x.copy_(torch.randn(num_tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16))
        drop.zero_()
        drop[1, seed] = 1
        graph.replay()
        eager = step()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        weights, ids = moe_ref.moe_route(logits, top_k, renormalize=True)
        ids[1, seed] = -1
        assert rel_err(out, moe_ref.fused_moe(x, args["w13"], args["w2"], weights, ids)) < TOL[torch.bfloat16]


class TestPathChoice:
    def test_auto_gives_gemv_to_at_most_two_tokens(self):
        assert dec.GEMV_MAX_ASSIGNMENTS == 32 and dec.GEMV_MAX_TOKENS == 2
        assert [dec.select_path(t, 8) for t in (1, 2, 3, 5)] == ["gemv", "gemv", "tiled", "tiled"]
        assert dec.select_path(2, 16) == "gemv" and dec.select_path(2, 17) == "tiled"  # and T * K <= 32
        assert dec.select_path(1, 8, tm.default_moe_config(1, 8, 128, torch.bfloat16)) == "tiled"  # a tile config
        assert dec.select_path(64, 8, path="gemv") == "gemv" and dec.select_path(1, 8, path="tiled") == "tiled"

    def test_unknown_paths_are_clear_errors(self):
        with pytest.raises(ValueError, match="unknown MoE path 'fast'; expected one of: auto, gemv, tiled"):
            dec.select_path(1, 8, path="fast")

    @pytest.mark.parametrize("num_tokens,path,expected", [
        (2, "auto", "gemv"), (3, "auto", "tiled"), (1, "gemv", "gemv"), (1, "tiled", "tiled")])
    def test_launch_fused_moe_dispatches(self, monkeypatch, num_tokens, path, expected):
        """What launch_fused_moe runs (kernels replaced by recorders: no GPU or interpreter)."""
        ran = []

        class TiledRan(Exception):
            pass

        def align(*args):
            ran.append("tiled")
            raise TiledRan

        monkeypatch.setattr(dec, "fused_moe_gemv", lambda *args: ran.append("gemv") or args[9])
        monkeypatch.setattr(tm, "moe_align_block_size", align)
        args = make_inputs(("dispatch", num_tokens), num_tokens, 16, 8, 32, 16, torch.bfloat16, "cpu")
        try:
            tm.launch_fused_moe(**args, path=path)
        except TiledRan:
            pass
        assert ran == [expected]
        with pytest.raises(ValueError, match="unknown MoE path"):
            tm.launch_fused_moe(**args, path="fast")


class TestBench:
    def test_floor_counts_the_touched_experts(self):
        """As the profiles count (docs/PERFORMANCE.md): 8 Qwen3-30B-A3B experts are 75.5 MB, 6 DeepSeek-V2-Lite
        ones 104 MB."""
        from benchmarks.kernels.moe_decode_bench import SHAPES, floor_bytes

        qwen3, dsv2 = SHAPES["qwen3-30b-a3b"], SHAPES["deepseek-v2-lite"]
        assert round(floor_bytes(*qwen3[:4], 1, qwen3[6]) / 1e6, 1) == 75.5
        assert round(floor_bytes(*dsv2[:4], 1, dsv2[6]) / 1e6) == 104
        assert floor_bytes(*qwen3[:4], 16, False) == 128 * 3 * 2048 * 768 * 2 + 2 * 16 * 2048 * 2  # all 128 experts

    def test_refuses_bad_arguments_and_runs_only_on_cuda(self, monkeypatch, capsys):
        from benchmarks.kernels import moe_decode_bench

        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        for argv, message in ((["--shapes", "llama"], "unknown shape 'llama'; expected one of: qwen3-30b-a3b"),
                              (["--m", "0"], "--m takes positive integers, got '0'"),
                              (["--m", "one"], "--m takes positive integers, got 'one'")):
            with pytest.raises(SystemExit):
                moe_decode_bench.main(argv)
            assert message in capsys.readouterr().err
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            moe_decode_bench.main(["--shapes", "deepseek-v2-lite", "--m", "1"])
