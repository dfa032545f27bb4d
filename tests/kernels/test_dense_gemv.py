"""The unquantized decode GEMV (`kernels/triton/dense_gemv.py`) and its dispatch (`quant/unquantized.py`).

- the kernel equals `dense_gemv_ref` (a float32 matmul rounded once) on fresh random inputs: `cpu`
  cases under Triton's interpreter (M 1-4; N and K multiples and non-multiples of 128 and of the
  tiles; bias; split-K forced on and off; x and W in float32/bf16/fp16); `cuda` cases (marker
  `gpu`) at Llama-3-8B and Llama-3.1-70B projection shapes, whole and halved for TP=2, and replayed
  in a CUDA graph;
- which kernel a linear runs: its table (made for its weight's device) gives CUDA linears the GEMV at
  1 token and F.linear above, other devices F.linear, and the LM head the same.

    TRITON_INTERPRET=1 python -m pytest tests/kernels/test_dense_gemv.py -q
    python -m pytest -m gpu tests/kernels/test_dense_gemv.py -q        (NOT run on a GPU yet)
"""
from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from atom_core.quant import unquantized
from atom_core.quant.unquantized import dense_linear, dense_linear_table
from tests.kernels.conftest import device  # noqa: F401  (the cpu-interpreter / cuda fixture)
from tests.kernels.tolerances import INTERPRET, TOL, rel_err

F32_TOL = 1e-5  # the same float32 products summed in another order
BF16_ON_CUDA = 4e-3  # rare elements one bf16 step apart after the float32 sums round
SHAPES = [(1, 96, 200), (2, 128, 256), (3, 130, 384), (4, 40, 520)]  # tiny for the interpreter


def _gemv():
    from atom_core.kernels.triton import dense_gemv

    return dense_gemv


def _inputs(m, n, k, dtype, device, seed, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device) if bias else None
    return x, w, b


def _tol(dtype, device):
    if dtype == torch.float32:
        return F32_TOL
    return TOL[dtype] if device == "cpu" else BF16_ON_CUDA


class TestKernel:
    @pytest.mark.parametrize("m,n,k", SHAPES)
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
    def test_matches_reference(self, device, m, n, k, dtype):
        gemv = _gemv()
        x, w, b = _inputs(m, n, k, dtype, device, seed=m * 1000 + n + k, bias=m % 2 == 1)
        out = gemv.dense_gemv(x, w, b)
        assert out.dtype == dtype and out.shape == (m, n)
        assert rel_err(out, gemv.dense_gemv_ref(x, w, b)) < _tol(dtype, device)

    @pytest.mark.parametrize("split_k", [1, 3])
    def test_forced_split_and_leading_dims(self, device, split_k):
        gemv = _gemv()
        x, w, b = _inputs(4, 72, 600, torch.float32, device, seed=11, bias=True)
        cfg = replace(gemv.default_dense_gemv_config(4, 72, 600, 4, 4), block_k=64, split_k=split_k)
        out = gemv.dense_gemv(x.view(2, 2, 600), w, b, config=cfg)
        assert out.shape == (2, 2, 72)
        assert rel_err(out.view(4, 72), gemv.dense_gemv_ref(x, w, b)) < F32_TOL

    def test_no_rows(self, device):
        gemv = _gemv()
        x, w, _ = _inputs(1, 16, 32, torch.float32, device, seed=3)
        assert gemv.dense_gemv(x[:0], w).shape == (0, 16)


def test_bad_arguments_are_clear_errors():
    gemv = _gemv()
    x, w = torch.randn(2, 64), torch.randn(32, 64)
    with pytest.raises(ValueError, match="at most 4 rows"):
        gemv.dense_gemv(torch.randn(5, 64), w)
    with pytest.raises(ValueError, match="in x's dtype"):
        gemv.dense_gemv(x, w.bfloat16())
    with pytest.raises(ValueError, match="columns"):
        gemv.dense_gemv(x[:, :32], w)
    with pytest.raises(ValueError, match="bias must be"):
        gemv.dense_gemv(x, w, torch.zeros(3))
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        gemv.dense_gemv(x.double(), w.double())
    with pytest.raises(ValueError, match="contiguous rows"):
        gemv.dense_gemv(x, torch.randn(64, 32).t())


def test_default_tiles_count_two_byte_weights():
    """H100 (132 SMs), bf16: at 1 token Llama-3-8B's and 70B's projections (whole and TP=2 halves)
    stream one weight row a program in 1,024-column steps (8 weights a thread: one 16-byte load)
    without split-K, the tile the H100 sweep found fastest; at 2-4 tokens, the FP8 GEMV's
    512-column steps. A narrow N splits K into runs of whole steps."""
    config = _gemv().default_dense_gemv_config
    for n, k in ((6144, 4096), (3072, 4096), (4096, 2048), (14336, 4096), (4096, 7168), (5120, 8192),
                 (8192, 4096), (28672, 8192), (8192, 14336)):
        one, few = config(1, n, k, 2, 132), config(3, n, k, 2, 132)
        assert (one.block_n, one.block_k, one.split_k) == (1, 1024, 1), (n, k, one)
        assert (few.block_k, few.split_k) == (512, 1), (n, k, few)
    assert config(1, 512, 300, 2, 132).block_k == 512  # a step no wider than K's power of two
    assert config(1, 4096, 4096, 4, 132) == _gemv().default_fp8_gemv_config(1, 4096, 4096, 4, None, 132, w_bytes=4)
    narrow = config(1, 512, 8192, 2, 132)
    assert 1 < narrow.split_k <= 8


class TestDispatch:
    def test_cuda_tables_take_the_gemv_at_one_token_only(self):
        table = dense_linear_table("cuda")
        assert table(1) is dense_linear
        assert table(2) is table(4) is table(4096) is F.linear
        assert dense_linear_table(torch.device("cuda", 1)).names == table.names

    def test_cpu_tables_are_f_linear_everywhere(self):
        table = dense_linear_table("cpu")
        assert table(1) is table(8) is F.linear

    def test_weights_without_contiguous_rows_take_f_linear(self, monkeypatch):
        """A weight the GEMV cannot stream (a transposed view) goes to F.linear instead of failing the forward."""
        calls = []
        monkeypatch.setattr(_gemv(), "dense_gemv", lambda *a, **k: calls.append(a) or F.linear(*a))
        x, weight = torch.randn(1, 16), torch.randn(16, 8).t()
        assert torch.equal(unquantized.dense_linear(x, weight), F.linear(x, weight))
        assert not calls
        unquantized.dense_linear(x, torch.randn(8, 16))  # and a plain one does reach the GEMV
        assert len(calls) == 1

    def test_a_built_linear_and_lm_head_hold_their_table(self):
        from atom_core.model_ops.embed_head import LMHead
        from atom_core.model_ops.linear import ReplicatedLinear

        layer = ReplicatedLinear(16, 8, bias=False)
        layer.weight.data.normal_()
        head = LMHead(8, 16)
        assert layer.kernel_table.names == head.kernel_table.names == ((None, "linear"),)  # built on the CPU
        with torch.device("meta"):
            assert LMHead(8, 16).kernel_table.names == ((None, "linear"),)
        x = torch.randn(2, 16)
        head.weight.data.copy_(layer.weight)
        assert torch.equal(layer(x), F.linear(x, layer.weight)) and torch.equal(head(x), F.linear(x, layer.weight))

    def test_forward_runs_the_kernel_its_table_gives_its_token_count(self, monkeypatch):
        """A CUDA table (made here for CPU tensors) sends 1 token to atom::dense_linear (recorded) and 3 to
        F.linear, for a linear layer and the LM head alike."""
        seen = []
        from atom_core.model_ops.embed_head import LMHead
        from atom_core.model_ops.linear import ReplicatedLinear
        from atom_core.kernel_config import KernelTable

        record = lambda x, w, b=None: seen.append(x.shape[0]) or F.linear(x, w, b)  # noqa: E731
        table = KernelTable(((1, record), (None, F.linear)))
        layer, head = ReplicatedLinear(16, 8, bias=False), LMHead(8, 16)
        layer.weight.data.normal_()
        layer.kernel_table = head.kernel_table = table
        for rows in (1, 3):
            x = torch.randn(rows, 16)
            assert torch.equal(layer(x), F.linear(x, layer.weight)) and head(x).shape == (rows, 8)
        assert seen == [1, 1]


def _routes(fn, *shapes, dynamic=False):
    """Whether each call of fn(x, w) on x of these shapes went through atom::dense_linear, as a
    compiled graph records it (a backend that only reads the traced graph, then runs it)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(any("dense_linear" in str(n.target) for n in gm.graph.nodes if n.op == "call_function"))
        return gm

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, dynamic=dynamic, fullgraph=True)
    w = torch.randn(8, 16)
    for shape in shapes:
        compiled(torch.randn(*shape), w)
    return graphs


class TestRoutingByTokenCount:
    """unquantized_linear looks the token count up in its table: larger batches never see the custom
    op (Inductor plans a plain F.linear); under torch.compile 1 token is specialised and any other
    count is symbolic, so one graph per side and no guard on the count."""

    @pytest.fixture(autouse=True)
    def as_on_cuda(self, monkeypatch):
        monkeypatch.setattr(_gemv(), "dense_gemv", lambda x, w, b=None, **k: F.linear(x, w, b))

    def test_cuda_table(self):
        table = dense_linear_table("cuda")
        run = lambda x, w: unquantized.unquantized_linear(x, w, None, table)  # noqa: E731
        assert _routes(run, (1, 16), (3, 16)) == [True, False]
        assert _routes(run, (1, 1, 16)) == [True]  # rows over leading dims
        assert _routes(run, (5, 16), (7, 16), dynamic=True) == [False]  # one symbolic graph
        assert _routes(run, (1, 16), dynamic=True) == [True]  # 1 is specialised

    def test_cpu_table(self):
        table = dense_linear_table("cpu")
        assert _routes(lambda x, w: unquantized.unquantized_linear(x, w, None, table), (1, 16)) == [False]

    def test_results_equal_f_linear_either_way(self):
        table = dense_linear_table("cuda")
        w, b = torch.randn(8, 16), torch.randn(8)
        for rows in (1, 3):
            x = torch.randn(rows, 16)
            assert torch.equal(unquantized.unquantized_linear(x, w, b, table), F.linear(x, w, b))


class TestBenchSweep:
    def test_sweep_tiles_are_valid_distinct_and_include_the_default(self):
        from benchmarks.kernels.dense_gemv_bench import sweep_configs
        from atom_core.kernels.triton.fp8_gemv import check_gemv_config

        base = _gemv().default_dense_gemv_config(1, 3072, 4096, 2, 132)
        tiles = sweep_configs(base)
        assert base in tiles and len(tiles) == len(set(tiles)) > 12
        for cfg in tiles:
            check_gemv_config(cfg, None)
        assert {c.block_k for c in tiles} == {128, 256, 512, 1024} and {c.split_k for c in tiles} >= {1, 2}

    @pytest.mark.parametrize("args, message", [
        (["--m", "1,8"], "--m takes token counts from 1 to 4"),
        (["--model", "llama-3-8b,gpt-2"], "--model: unknown gpt-2; known: llama-3-8b, llama-3.1-70b"),
        (["--tp", "1,4"], "--tp takes 1 and/or 2, got 1,4"),
    ])
    def test_bad_arguments_are_a_clear_error(self, args, message):
        run = subprocess.run([sys.executable, "-m", "benchmarks.kernels.dense_gemv_bench", *args, "--sweep"],
                             capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
        assert run.returncode != 0 and message in run.stderr

    def test_shapes_per_rank_and_the_model_filter(self):
        from benchmarks.kernels.dense_gemv_bench import shapes

        tp2 = {(model, name): (n, k) for model, name, n, k in shapes(2, ("llama-3-8b",))}
        assert {model for model, _ in tp2} == {"llama-3-8b"}
        assert tp2["llama-3-8b", "qkv"] == (3072, 4096) and tp2["llama-3-8b", "o"] == (4096, 2048)  # column / row split
        assert len(shapes(1)) == len(shapes(1, ("llama-3-8b",))) + len(shapes(1, ("llama-3.1-70b",)))


def test_every_sweep_tile_computes_the_product():
    """The sweep only times tiles; each must still be right (here on a small shape, M = 1 and 3)."""
    from benchmarks.kernels.dense_gemv_bench import sweep_configs

    gemv = _gemv()
    for m in (1, 3):
        x, w, b = _inputs(m, 24, 256, torch.float32, "cpu", seed=9, bias=True)
        for cfg in sweep_configs(gemv.default_dense_gemv_config(m, 24, 256, 4, 8)):
            assert rel_err(gemv.dense_gemv(x, w, b, config=cfg), gemv.dense_gemv_ref(x, w, b)) < F32_TOL, cfg


@pytest.mark.skipif(not INTERPRET, reason="runs the GEMV under the interpreter (TRITON_INTERPRET=1)")
def test_the_op_runs_the_gemv(monkeypatch):
    """atom::dense_linear runs the GEMV (interpreter) eagerly and through torch.compile; a CUDA table
    sends 1 token to it."""
    gemv = _gemv()
    calls = []
    real = gemv.dense_gemv
    monkeypatch.setattr(gemv, "dense_gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x, w, b = _inputs(3, 40, 96, torch.float32, "cpu", seed=5, bias=True)
    assert rel_err(dense_linear(x, w, b), gemv.dense_gemv_ref(x, w, b)) < F32_TOL and calls == [1]
    compiled = torch.compile(lambda t: dense_linear(t, w, b) * 2, fullgraph=True)
    assert rel_err(compiled(x), 2 * gemv.dense_gemv_ref(x, w, b)) < F32_TOL and calls == [1, 1]
    x1 = x[:1]
    out = unquantized.unquantized_linear(x1, w, b, dense_linear_table("cuda"))
    assert rel_err(out, gemv.dense_gemv_ref(x1, w, b)) < F32_TOL and calls == [1, 1, 1]


# ---- GPU: model shapes and graphs --------------------------------------------------------------

# (N, K) of Llama-3-8B (qkv, o, gate_up, down) and Llama-3.1-70B, whole and per rank at TP=2
GPU_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (3072, 4096), (4096, 2048),
              (14336, 4096), (4096, 7168), (5120, 8192), (8192, 4096), (28672, 8192), (8192, 14336)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA")
@pytest.mark.parametrize("n,k", GPU_SHAPES)
@pytest.mark.parametrize("m", [1, 4])
def test_model_shapes_match_reference_on_cuda(n, k, m):
    gemv = _gemv()
    x, w, b = _inputs(m, n, k, torch.bfloat16, "cuda", seed=n + k + m, bias=m == 4)
    assert rel_err(gemv.dense_gemv(x, w, b), gemv.dense_gemv_ref(x, w, b)) < BF16_ON_CUDA
    assert rel_err(gemv.dense_gemv(x, w, b), F.linear(x, w, b)) < 1e-2  # cuBLAS: another summation order


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA")
def test_replays_in_a_cuda_graph():
    gemv = _gemv()
    x, w, _ = _inputs(2, 4096, 4096, torch.bfloat16, "cuda", seed=9)
    static = torch.zeros_like(x)
    gemv.dense_gemv(static, w)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv.dense_gemv(static, w)
    static.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, gemv.dense_gemv_ref(x, w)) < BF16_ON_CUDA


# ---- offline sm_90 compile (Triton's bundled ptxas; no GPU) ---------------------------------------

@pytest.mark.skipif(INTERPRET, reason="the interpreter replaces the compiled kernels")
@pytest.mark.parametrize("m,n,k", [(1, 6144, 4096), (1, 4096, 14336), (2, 3072, 4096), (4, 8192, 4096)])
def test_default_tiles_compile_for_hopper_without_spills(m, n, k):
    """bf16 weights and x: no local-memory spills, 16-byte weight loads (8 bf16, x's layout), and no
    layout conversion in the K loop (only the epilogue's, one per row of x)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from atom_core.kernels.triton.fp8_gemv import _fp8_gemv_kernel as fn
    from tests.kernels.sm90_compile import cuobjdump_path, stack_bytes

    if cuobjdump_path() is None:
        pytest.skip("Triton ships no cuobjdump here")
    cfg = _gemv().default_dense_gemv_config(m, n, k, 2, 132)
    strides = ("stride_xm", "stride_wn", "stride_wsn", "stride_om", "stride_os")
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "ws_ptr": "*fp32", "bias_ptr": "*bf16",
           "out_ptr": "*fp32" if cfg.split_k > 1 else "*bf16", "steps_per_split": "i32", **{s: "i32" for s in strides}}
    consts = dict(M=m, N=n, K=k, HAS_BIAS=False, IS_SPLIT=cfg.split_k > 1,
                  BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, VEC=8)
    aligned = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items()
               if t.startswith("*") or a in ("stride_xm", "stride_wn", "stride_om", "stride_os")}
    src = ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in consts}}, constexprs=consts, attrs=aligned)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg.num_warps, "num_stages": 1})
    assert stack_bytes(kernel) == 0
    assert "ld.global.v4.b32" in kernel.asm["ptx"], "weights should load 16 bytes at a time"
    assert kernel.asm["ttgir"].count("ttg.convert_layout") <= m
