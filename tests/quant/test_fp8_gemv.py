"""The weight-only FP8 GEMV (`kernels/triton/fp8_gemv.py`) and its dispatch (`quant/fp8_ops.py`).

- the kernels equal `fp8_gemv_ref` (W dequantized to float32, x not quantized, a float32 matmul) on
  fresh random inputs: `cpu` cases under Triton's interpreter (tiny: M 1-4, N and K multiples and
  non-multiples of 128 and of the tiles, per-tensor / per-channel / block row-expanded and compact
  scales, split-K forced on and off, bias, x in float32/bf16/fp16); the reference against a float64
  loop oracle; `cuda` cases (marker `gpu`) at Llama-3-8B and DeepSeek-V3 shapes, CUDA-graph replay,
  and the custom ops taking the GEMV at 1 token;
- that the ops run the GEMV where a table holds it (a static input_scale keeps its path; the tables
  themselves: test_fp8_gemm.py);
- the default tiles, and offline sm_90 compiles of them without spills or in-loop layout changes.

    TRITON_INTERPRET=1 python -m pytest tests/quant/test_fp8_gemv.py -q
    python -m pytest tests/quant/test_fp8_gemv.py -q                (dispatch, tiles, sm_90 compiles)
    python -m pytest -m gpu tests/quant/test_fp8_gemv.py -q         (NOT run on a GPU yet)

Tolerances: kernel and reference sum the same float32 products in another order (the kernel
multiplies a per-channel scale into each row's sum instead of into W), so float32 results agree
to ~1e-7; half dtypes round the same float32 value once (the interpreter truncates to bf16/fp16:
TOL; on CUDA both round to nearest: BF16_ON_CUDA).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import triton

from atom_core.quant import fp8_ops
from atom_core.quant.fp8_ops import FP8_DTYPE, fp8_block_linear, fp8_linear, fp8_linear_ref
from tests.kernels.conftest import device  # noqa: F401  (the cpu-interpreter / cuda fixture)
from tests.kernels.tolerances import INTERPRET, TOL, rel_err
from tests.quant.test_fp8_gemm import _gpu_shapes, block_weight, channel_weight, random_fp8, seeded, to
from tests.quant.test_fp8_ops import _oracle_w_block

F32_TOL = 1e-5
BF16_ON_CUDA = 4e-3  # rare elements one bf16 step apart (float32 sums in another order, then rounded)


def _gemv():
    from atom_core.kernels.triton import fp8_gemv

    return fp8_gemv


def _config(m, n, k, x_bytes=4, group=None, **changes):
    return replace(_gemv().default_fp8_gemv_config(m, n, k, x_bytes, group, 4), **changes)


# (M, N, K): M 1-4; N and K multiples and non-multiples of 128 and of the tiles; tiny for the interpreter
SHAPES = [(1, 96, 200), (2, 128, 256), (3, 130, 384), (4, 40, 520)]


class TestChannelGemv:
    @pytest.mark.parametrize("m,n,k", SHAPES)
    def test_per_channel_matches_reference(self, device, m, n, k):
        gen = seeded("gemv-channel", m, n, k)
        w, s = channel_weight(gen, n, k)
        x, bias = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
        x, w, s, bias = to(device, x, w, s, bias)
        use_bias = bias if m % 2 else None
        out = _gemv().fp8_channel_gemv(x, w, s, use_bias)
        assert out.shape == (m, n) and rel_err(out, _gemv().fp8_gemv_ref(x, w, s, None, use_bias)) < F32_TOL

    @pytest.mark.parametrize("split_k", [1, 3])
    def test_per_tensor_scale_and_forced_split(self, device, split_k):
        """Per-tensor scale [1]; split-K forced on (uneven runs: 9 steps of 64 over 3) and off."""
        gen = seeded("gemv-tensor", split_k)
        w, _ = channel_weight(gen, 72, 560)
        s = torch.rand(1, generator=gen) * 1e-2 + 1e-3
        x, bias = torch.randn(2, 560, generator=gen), torch.randn(72, generator=gen)
        x, w, s, bias = to(device, x, w, s, bias)
        cfg = _config(2, 72, 560, block_k=64, split_k=split_k)
        out = _gemv().fp8_channel_gemv(x, w, s, bias, config=cfg)
        assert rel_err(out, _gemv().fp8_gemv_ref(x, w, s, None, bias)) < F32_TOL

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_half_inputs_keep_their_dtype_and_leading_dims(self, device, dtype):
        gen = seeded("gemv-half", dtype)
        w, s = channel_weight(gen, 136, 256)
        x, w, s = to(device, torch.randn(2, 2, 256, generator=gen).to(dtype), w, s)
        out = _gemv().fp8_channel_gemv(x, w, s)
        assert out.dtype == dtype and out.shape == (2, 2, 136)
        assert rel_err(out, _gemv().fp8_gemv_ref(x, w, s)) < TOL[dtype]

    def test_no_rows(self, device):
        w, s = channel_weight(seeded("gemv-empty"), 64, 128)
        assert _gemv().fp8_channel_gemv(*to(device, torch.zeros(0, 128), w, s)).shape == (0, 64)


class TestBlockGemv:
    @pytest.mark.parametrize("m,n,k", SHAPES)
    @pytest.mark.parametrize("row_expanded", [True, False])
    def test_matches_reference(self, device, m, n, k, row_expanded):
        gen = seeded("gemv-block", m, n, k, row_expanded)
        w, s, block = block_weight(gen, n, k, row_expanded)
        x, bias = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
        x, w, s, bias = to(device, x, w, s, bias)
        use_bias = bias if (m + row_expanded) % 2 else None
        out = _gemv().fp8_block_gemv(x, w, s, block, use_bias)
        assert rel_err(out, _gemv().fp8_gemv_ref(x, w, s, block, use_bias)) < F32_TOL

    @pytest.mark.parametrize("group,block_k", [(96, 64), (100, 16)])
    def test_groups_that_steps_do_not_divide(self, device, group, block_k):
        """A 64-column step over 96-column groups (chunks of 8 straddle no group) and 100-column
        groups (chunks narrow to 4 columns); 1 and 2 tokens, K tail."""
        gen = seeded("gemv-groups", group, block_k)
        w, s = fp8_ops.quantize_fp8_block(torch.randn(40, 330, generator=gen) / 330 ** 0.5, (1, group))
        for m in (1, 2):
            x = torch.randn(m, 330, generator=gen).to(torch.bfloat16)
            xd, wd, sd = to(device, x, w, s)
            out = _gemv().fp8_block_gemv(xd, wd, sd, [1, group], config=_gemv().Fp8GemvConfig(8, block_k, 4, 1))
            assert rel_err(out, _gemv().fp8_gemv_ref(xd, wd, sd, [1, group])) < TOL[torch.bfloat16]

    @pytest.mark.parametrize("block_k,split_k", [(64, 1), (64, 4), (256, 2)])
    def test_steps_inside_and_across_groups_with_splits(self, device, block_k, split_k):
        """A step inside one 128-column group (64) or over two (256), split-K on and off, K tail."""
        gen = seeded("gemv-steps", block_k, split_k)
        w, s, block = block_weight(gen, 48, 600)
        x = torch.randn(4, 600, generator=gen)
        x, w, s = to(device, x, w, s)
        cfg = _config(4, 48, 600, group=128, block_k=block_k, split_k=split_k)
        out = _gemv().fp8_block_gemv(x, w, s, block, config=cfg)
        assert rel_err(out, _gemv().fp8_gemv_ref(x, w, s, block)) < F32_TOL

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_half_inputs_and_odd_group(self, device, dtype):
        """[64, 96] blocks: the step narrows to 32 columns (the group's power-of-two divisor)."""
        gen = seeded("gemv-odd", dtype)
        w, s = fp8_ops.quantize_fp8_block(torch.randn(100, 300, generator=gen) / 300 ** 0.5, (64, 96))
        x, w, s = to(device, torch.randn(3, 300, generator=gen).to(dtype), w, s)
        out = _gemv().fp8_block_gemv(x, w, s, [64, 96])
        assert out.dtype == dtype and rel_err(out, _gemv().fp8_gemv_ref(x, w, s, [64, 96])) < TOL[dtype]


def test_reference_equals_float64_oracle():
    """fp8_gemv_ref's dequantization against test_fp8_ops' loop oracle (float64, never our helpers)."""
    gen = seeded("gemv-oracle")
    w = (torch.randn(70, 200, generator=gen) * 100).clamp(-448, 448).to(FP8_DTYPE)
    s = torch.rand(2, 4, generator=gen) * 1e-3 + 1e-4
    x = torch.randn(3, 200, generator=gen)
    want = x.double() @ _oracle_w_block(w, s, 64, 64).t()
    assert rel_err(_gemv().fp8_gemv_ref(x, w, s, [64, 64]).double(), want) < 1e-6
    sc = torch.rand(70, 1, generator=gen) * 1e-3
    assert rel_err(_gemv().fp8_gemv_ref(x, w, sc).double(), x.double() @ (w.double() * sc.double()).t()) < 1e-6


def test_bad_arguments_are_clear_errors():
    gemv = _gemv()
    w, s, block = block_weight(seeded("gemv-bad"), 64, 256)
    wc, sc = channel_weight(seeded("gemv-bad-c"), 64, 256)
    x = torch.randn(2, 256)
    with pytest.raises(ValueError, match="at most 4 rows"):
        gemv.fp8_channel_gemv(torch.randn(5, 256), wc, sc)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        gemv.fp8_block_gemv(x, w.float(), s, block)
    with pytest.raises(ValueError, match="weight_scale_inv must be"):
        gemv.fp8_block_gemv(x, w, s[:, :1], block)
    with pytest.raises(ValueError, match="block_size must be"):
        gemv.fp8_block_gemv(x, w, s, [1])
    with pytest.raises(ValueError, match="1 or N=64 values"):
        gemv.fp8_channel_gemv(x, wc, sc[:3])
    with pytest.raises(ValueError, match="columns"):
        gemv.fp8_channel_gemv(x[:, :128], wc, sc)
    with pytest.raises(ValueError, match="bias must be"):
        gemv.fp8_channel_gemv(x, wc, sc, torch.zeros(3))
    with pytest.raises(ValueError, match="power-of-two"):
        gemv.fp8_channel_gemv(x, wc, sc, config=_config(2, 64, 256, block_k=96))


class TestDefaultTiles:
    def test_llama_shapes_stream_without_split_and_narrow_n_splits(self):
        """H100 (132 SMs), bf16 x: a step of 512 columns; Llama-3-8B's projections fill the GPU
        without split-K; DeepSeek-V3's kv_a (N 576) splits K into runs of whole steps."""
        config = _gemv().default_fp8_gemv_config
        for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
            for m in (1, 4):
                cfg = config(m, n, k, 2, None, 132)
                assert (cfg.block_k, cfg.split_k) == (512, 1)
                assert cfg.block_n * cfg.block_k // (32 * cfg.num_warps) == (32 if m <= 2 else 16)  # weights a thread
        kv_a = config(1, 576, 7168, 2, 128, 132)
        per_split = triton.cdiv(7168 // 512, kv_a.split_k)
        assert 1 < kv_a.split_k <= 8 and (kv_a.split_k - 1) * per_split < 7168 // 512  # runs of whole steps, none empty
        assert config(1, 100, 300, 2, 96, 132).block_k == 512  # any step suits any group
        assert (_gemv().block_vec(8, 128), _gemv().block_vec(8, 96), _gemv().block_vec(8, 100)) == (8, 8, 4)
        assert config(1, 64, 40, 4, None, 132).block_k == 64  # small K: one step


class TestDispatch:
    def test_custom_ops_stay_on_the_reference_on_cpu(self):
        gen = seeded("gemv-cpu-ops")
        w, s, block = block_weight(gen, 64, 256)
        x = torch.randn(1, 256, generator=gen)
        assert torch.equal(fp8_block_linear(x, w, s, block), fp8_ops.fp8_block_linear_ref(x, w, s, block))
        wc, sc = channel_weight(gen, 64, 256)
        assert torch.equal(fp8_linear(x, wc, sc), fp8_linear_ref(x, wc, sc))


@pytest.mark.skipif(not INTERPRET, reason="runs the GEMV under the interpreter (TRITON_INTERPRET=1)")
def test_custom_ops_run_the_gemv_at_one_token(monkeypatch):
    """The ops on a device told it is an SM90 GPU (interpreter): at 1 token dynamic per-channel and
    block linears run the GEMV (W8A16: equal to fp8_gemv_ref, not to the activation-quantizing
    references); a static input_scale keeps the Triton GEMM (float32 x: no _scaled_mm)."""
    from atom_core.kernels.triton import fp8_gemm
    from tests.quant.test_fp8_gemm import CUDA, as_sm90

    gemv = _gemv()
    calls = []
    for module, fn in ((gemv, "fp8_channel_gemv"), (gemv, "fp8_block_gemv"), (fp8_gemm, "fp8_channel_gemm")):
        real = getattr(module, fn)
        monkeypatch.setattr(module, fn, lambda *a, _f=fn, _r=real, **kw: calls.append(_f) or _r(*a, **kw))
    as_sm90(monkeypatch)
    channel = fp8_ops.fp8_linear_table(CUDA, 64, 256, torch.float32, False)
    static = fp8_ops.fp8_linear_table(CUDA, 64, 256, torch.float32, True)
    block_table = fp8_ops.fp8_block_linear_table(CUDA, torch.float32, [1, 128])
    gen = seeded("gemv-ops")
    wc, sc = channel_weight(gen, 64, 256)
    w, s, block = block_weight(gen, 64, 256)
    x, bias = torch.randn(1, 1, 256, generator=gen), torch.randn(64, generator=gen)
    got = fp8_linear(x, wc, sc, None, bias, channel.key)
    assert rel_err(got, gemv.fp8_gemv_ref(x, wc, sc, None, bias)) < F32_TOL
    got = fp8_block_linear(x, w, s, block, None, block_table.key)
    assert rel_err(got, gemv.fp8_gemv_ref(x, w, s, block)) < F32_TOL
    assert calls == ["fp8_channel_gemv", "fp8_block_gemv"]
    in_s = torch.tensor(x.abs().max().item() / 448)
    assert rel_err(fp8_linear(x, wc, sc, in_s, None, static.key), fp8_linear_ref(x, wc, sc, in_s)) < F32_TOL
    assert calls[2:] == ["fp8_channel_gemm"]


def test_bench_refuses_both_sweeps_at_once(monkeypatch):
    from benchmarks.kernels import fp8_bench

    monkeypatch.setattr("sys.argv", ["fp8_bench", "--sweep", "--sweep-gemv"])
    with pytest.raises(SystemExit, match="separate runs"):
        fp8_bench.main()


# ---------------------------------------------------------------------------------------------
# GPU (not run yet: written in a session without one)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="interpreter mode")
class TestOnCuda:
    @pytest.mark.parametrize("model,name", _gpu_shapes())
    @pytest.mark.parametrize("m", [1, 2, 4])
    def test_model_shapes_match_reference(self, model, name, m):
        """Block (row-expanded) at every shape; per channel at Llama-3-8B's (online fp8); bf16 x."""
        from benchmarks.kernels.fp8_bench import SHAPES

        gemv = _gemv()
        n, k = SHAPES[model][name]
        x = torch.randn(m, k, device="cuda").bfloat16()
        w, s = random_fp8(n, k, block=True)
        assert rel_err(gemv.fp8_block_gemv(x, w, s, [1, 128]), gemv.fp8_gemv_ref(x, w, s, [1, 128])) < BF16_ON_CUDA
        if model == "llama-3-8b":
            wc, sc = random_fp8(n, k, block=False)
            assert rel_err(gemv.fp8_channel_gemv(x, wc, sc), gemv.fp8_gemv_ref(x, wc, sc)) < BF16_ON_CUDA

    def test_float32_and_compact_block_scales(self):
        gemv = _gemv()
        x = torch.randn(3, 7168, device="cuda")
        w, s = random_fp8(576, 7168, block=True)
        compact = s[::128].contiguous()  # the checkpoint's [ceil(N/128), ceil(K/128)]
        assert rel_err(gemv.fp8_block_gemv(x, w, compact, [128, 128]), gemv.fp8_gemv_ref(x, w, compact, [128, 128])) < F32_TOL

    @pytest.mark.parametrize("m", [1, 4])
    def test_replays_in_a_cuda_graph(self, m):
        """No host sync: captured calls (a split and the split sum: N 576; no split: N 4096) replay to
        the eager result, bit for bit (deterministic)."""
        gemv = _gemv()
        x = torch.randn(m, 7168, device="cuda").bfloat16()
        wb, sb = random_fp8(576, 7168, block=True)
        wc, sc = random_fp8(4096, 7168, block=False)
        bias = torch.randn(4096, device="cuda").bfloat16()
        assert gemv.default_fp8_gemv_config(m, 576, 7168, 2, 128, torch.cuda.get_device_properties(0)
                                            .multi_processor_count).split_k > 1
        calls = (lambda: gemv.fp8_block_gemv(x, wb, sb, [1, 128]), lambda: gemv.fp8_channel_gemv(x, wc, sc, bias))
        for call in calls:
            call()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [call() for call in calls]
        x.copy_(torch.randn_like(x))
        graph.replay()
        for call, out in zip(calls, outs):
            assert torch.equal(out, call())
        assert rel_err(outs[0], gemv.fp8_gemv_ref(x, wb, sb, [1, 128])) < BF16_ON_CUDA

    def test_custom_ops_run_the_gemv_at_one_token(self, monkeypatch):
        gemv = _gemv()
        calls = []
        for fn in ("fp8_channel_gemv", "fp8_block_gemv"):
            real = getattr(gemv, fn)
            monkeypatch.setattr(gemv, fn, lambda *a, _f=fn, _r=real, **kw: calls.append(_f) or _r(*a, **kw))
        x = torch.randn(1, 512, device="cuda").bfloat16()
        wc, sc = random_fp8(256, 512, block=False)
        wb, sb = random_fp8(256, 512, block=True)
        assert rel_err(fp8_linear(x, wc, sc), gemv.fp8_gemv_ref(x, wc, sc)) < BF16_ON_CUDA
        assert rel_err(fp8_block_linear(x, wb, sb, [1, 128]), gemv.fp8_gemv_ref(x, wb, sb, [1, 128])) < BF16_ON_CUDA
        fp8_linear(x, wc, sc, torch.tensor(0.01, device="cuda"))  # static input scale: _scaled_mm
        fp8_linear(torch.randn(33, 512, device="cuda").bfloat16(), wc, sc)  # 33 tokens: _scaled_mm
        assert calls == ["fp8_channel_gemv", "fp8_block_gemv"]


# ---------------------------------------------------------------------------------------------
# offline sm_90 compile


@pytest.mark.skipif(INTERPRET, reason="the interpreter replaces the compiled kernels")
@pytest.mark.parametrize("m,n,k,block,x_type", [(1, 6144, 4096, False, "bf16"), (1, 4096, 14336, True, "bf16"),
                                                 (2, 28672, 4096, True, "fp16"), (4, 4096, 4096, False, "bf16"),
                                                 (4, 576, 7168, True, "bf16"), (4, 4096, 4096, True, "fp32")])
def test_default_tiles_compile_for_hopper_without_spills(m, n, k, block, x_type):
    """The default tiles compile for sm_90 (Triton's bundled ptxas; no GPU): no local-memory spills,
    8-byte weight loads for half x (the layout of x's 16-byte loads), and no layout conversion in the
    K loop (only the epilogue's, one per row of x: a per-step one moved every tile through shared
    memory in a first draft)."""
    from tests.kernels.sm90_compile import cuobjdump_path, loop_sass, stack_bytes

    if cuobjdump_path() is None:
        pytest.skip("Triton ships no cuobjdump here")
    gemv = _gemv()
    x_bytes = 4 if x_type == "fp32" else 2
    cfg = gemv.default_fp8_gemv_config(m, n, k, x_bytes, 128 if block else None, 132)
    kernel = compile_gemv_sm90(m, n, k, block, x_type, cfg)
    assert stack_bytes(kernel) == 0
    assert "local_" not in kernel.asm["ttgir"], "no tile should move through shared memory"
    if x_bytes == 2:
        assert "ld.global.v2.b32" in kernel.asm["ptx"], "weights should load 8 bytes at a time"
    if not block:
        assert kernel.asm["ttgir"].count("ttg.convert_layout") <= m
        return
    # a scale per thread's chunk of VEC columns, not per weight: ~12 float ops per 8 weights and x row (2 before)
    body = loop_sass(kernel)
    float_ops = sum(op.split()[0].split(".")[0] in ("FMUL", "FFMA", "FADD") for op in body)
    weights = cfg.block_n * cfg.block_k // (32 * cfg.num_warps)
    assert float_ops <= 1.6 * weights * m, f"{float_ops} float ops for {weights} weights and {m} rows"


def compile_gemv_sm90(m, n, k, block, x_type, cfg):
    """One of the two kernels at the shape, compiled for sm_90 with the launch's constexprs and the
    16-divisibility Triton gives pointers and row strides."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    gemv = _gemv()
    x_bytes = 4 if x_type == "fp32" else 2
    fn = gemv._fp8_block_gemv_kernel if block else gemv._fp8_gemv_kernel
    strides = ("stride_xm", "stride_wn", "stride_wsn", "stride_wsk", "stride_om", "stride_os")
    sig = {"x_ptr": f"*{x_type}", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "bias_ptr": f"*{x_type}",
           "out_ptr": "*fp32" if cfg.split_k > 1 else f"*{x_type}", "steps_per_split": "i32",
           **{s: "i32" for s in strides if block or s != "stride_wsk"}}
    consts = dict(M=m, N=n, K=k, HAS_BIAS=True, IS_SPLIT=cfg.split_k > 1, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  VEC=16 // x_bytes)
    if block:
        consts.update(SCALE_BN=1, GROUP=128, VEC=gemv.block_vec(16 // x_bytes, 128), WIDE_ROWS=False)
    aligned = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items()
               if t.startswith("*") or a in ("stride_xm", "stride_wn", "stride_om", "stride_os")}
    src = ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in consts}}, constexprs=consts, attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg.num_warps, "num_stages": 1})
