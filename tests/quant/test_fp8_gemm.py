"""Dense FP8 GEMMs (`kernels/triton/fp8_gemm.py`) and the FP8 linears' dispatch (`quant/fp8_ops.py`).

- the kernels equal their torch references (`fp8_block_linear_ref`, `fp8_linear_ref`) on fresh random
  inputs: `cpu` cases under Triton's interpreter (tiny: M 1/7/16/64/300, N and K multiples and
  non-multiples of 128, every tile tier, fused and separate activation quantization, split-K,
  bias, static scales), and against test_fp8_ops' float64 oracle; `cuda` cases (marker `gpu`) at
  Llama-3-8B and DeepSeek-V3 projection shapes, a CUDA-graph replay, and the custom ops running the
  kernel on CUDA;
- the e4m3 rounding the fused quantizer uses under the interpreter equals torch's cast;
- the FP8 linears' per-M kernel tables (`fp8_linear_table`, `fp8_block_linear_table`), the ops' use of
  them, and the default tiles;
- the GEMM compiles for sm_90 offline (Triton's bundled ptxas) at each tile tier without spills.

    TRITON_INTERPRET=1 python -m pytest tests/quant/test_fp8_gemm.py -q
    python -m pytest tests/quant/test_fp8_gemm.py -q                (compile + dispatch checks)
    python -m pytest -m gpu tests/quant/test_fp8_gemm.py -q         (not run on a GPU yet)

Tolerances: kernel and reference quantize x to the same e4m3 codes and scales (up to a 1-ulp scale
difference on CUDA, see test_fp8_ops) and sum exact e4m3 products in float32 in another order, so
float32 results agree to ~1e-7 and TOL[float32] = 1e-3 holds with room; half dtypes round the same
float32 value once (the interpreter truncates to bf16: TOL[bfloat16]).
"""
from __future__ import annotations

import json
import zlib
from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl

from atom_core.kernels.triton.fp8_gemm import _quantize_tile
from atom_core.quant import fp8_ops
from atom_core.quant.fp8_ops import (
    FP8_DTYPE, fp8_block_linear, fp8_block_linear_ref, fp8_block_linear_table, fp8_linear, fp8_linear_ref,
    fp8_linear_table, quantize_fp8_block, quantize_fp8_per_token,
)
from atom_core.kernel_config import KernelTable
from tests.kernels.conftest import device  # noqa: F401  (the cpu-interpreter / cuda fixture)
from tests.kernels.tolerances import INTERPRET, TOL, rel_err, widen_fp8_dot_on_cuda
from tests.quant.test_fp8_ops import _oracle_w_block, _oracle_x


def seeded(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def block_weight(gen, n: int, k: int, row_expanded: bool = True):
    """A checkpoint-style block-FP8 weight (e4m3 [N, K], scales [ceil(N/128), ceil(K/128)]), with the
    scales row-expanded as the loader keeps them ([N, ceil(K/128)], block [1, 128]) or not."""
    q, s = quantize_fp8_block(torch.randn(n, k, generator=gen) / k ** 0.5)
    if row_expanded:
        return q, s.repeat_interleave(128, 0)[:n].contiguous(), [1, 128]
    return q, s, [128, 128]


def channel_weight(gen, n: int, k: int):
    return quantize_fp8_per_token(torch.randn(n, k, generator=gen) / k ** 0.5)  # per row of W: per channel


def to(device, *tensors):
    return [t.to(device) for t in tensors]


# (M, N, K): decode and prefill rows; N and K multiples and non-multiples of 128 (partial scale
# groups, K tails, N tails); tiny for the interpreter on two cores
SHAPES = [(1, 96, 200), (7, 256, 128), (16, 130, 256), (64, 64, 384), (300, 72, 136)]


class TestBlockGemm:
    @pytest.mark.parametrize("m,n,k", SHAPES)
    @pytest.mark.parametrize("row_expanded", [True, False])
    def test_matches_reference_float32(self, device, m, n, k, row_expanded, monkeypatch):
        from atom_core.kernels.triton import fp8_gemm
        from atom_core.kernels.triton.fp8_gemm import fp8_block_gemm

        widen_fp8_dot_on_cuda(monkeypatch, device, fp8_gemm)

        gen = seeded("block", m, n, k)
        w, s, block = block_weight(gen, n, k, row_expanded)
        x, bias = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
        x, w, s, bias = to(device, x, w, s, bias)
        assert rel_err(fp8_block_gemm(x, w, s, block, bias), fp8_block_linear_ref(x, w, s, block, bias)) < 1e-5

    @pytest.mark.parametrize("fused,split_k", [(True, 1), (True, 3), (False, 1), (False, 3)])
    @pytest.mark.parametrize("m", [1, 20])
    def test_each_quantization_and_split(self, device, fused, split_k, m):
        """Fused / separate activation quantization and split-K forced on small and tier-2 rows."""
        from atom_core.kernels.triton.fp8_gemm import default_fp8_gemm_config, fp8_block_gemm

        gen = seeded("variants", m)
        w, s, block = block_weight(gen, 80, 330)
        x = torch.randn(m, 330, generator=gen)
        x, w, s = to(device, x, w, s)
        cfg = replace(default_fp8_gemm_config(m, 80, 330, 128, 4), fused_quant=fused, split_k=split_k)
        assert rel_err(fp8_block_gemm(x, w, s, block, config=cfg), fp8_block_linear_ref(x, w, s, block)) < 1e-5

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("m", [1, 33])
    def test_half_inputs(self, device, dtype, m):
        from atom_core.kernels.triton.fp8_gemm import fp8_block_gemm

        gen = seeded("half", dtype, m)
        w, s, block = block_weight(gen, 136, 256)
        x, w, s = to(device, torch.randn(2, m, 256, generator=gen).to(dtype), w, s)
        out = fp8_block_gemm(x, w, s, block)
        assert out.dtype == dtype and out.shape == (2, m, 136)
        assert rel_err(out, fp8_block_linear_ref(x, w, s, block)) < TOL[dtype]

    def test_group_64_and_float64_oracle(self, device):
        """Block [64, 64] scales (K steps of 64), against the loop oracle of test_fp8_ops."""
        from atom_core.kernels.triton.fp8_gemm import fp8_block_gemm

        gen = seeded("g64")
        w = (torch.randn(70, 200, generator=gen) * 100).clamp(-448, 448).to(FP8_DTYPE)
        s = torch.rand(2, 4, generator=gen) * 1e-3 + 1e-4
        x = torch.randn(5, 200, generator=gen)
        want = _oracle_x(x, 64) @ _oracle_w_block(w, s, 64, 64).t()
        out = fp8_block_gemm(*to(device, x, w, s), [64, 64])
        assert rel_err(out.cpu().double(), want) < 1e-5

    def test_no_rows(self, device):
        from atom_core.kernels.triton.fp8_gemm import fp8_block_gemm

        w, s, block = block_weight(seeded("empty"), 64, 128)
        assert fp8_block_gemm(*to(device, torch.zeros(0, 128), w, s), block).shape == (0, 64)

    def test_bad_arguments_are_clear_errors(self):
        from atom_core.kernels.triton.fp8_gemm import default_fp8_gemm_config, fp8_block_gemm

        w, s, block = block_weight(seeded("bad"), 64, 256)
        x = torch.randn(2, 256)
        with pytest.raises(ValueError, match="float8_e4m3fn"):
            fp8_block_gemm(x, w.float(), s, block)
        with pytest.raises(ValueError, match="weight_scale_inv must be"):
            fp8_block_gemm(x, w, s[:, :1], block)
        with pytest.raises(ValueError, match="columns"):
            fp8_block_gemm(x[:, :128], w, s, block)
        with pytest.raises(ValueError, match="power-of-two divisor"):
            fp8_block_gemm(x, w, s, [1, 24])
        with pytest.raises(ValueError, match="bias must be"):
            fp8_block_gemm(x, w, s, block, torch.zeros(3))
        cfg = default_fp8_gemm_config(2, 64, 256, 128, 4)
        with pytest.raises(ValueError, match="fused block quantizer"):
            fp8_block_gemm(x, w, s, block, config=replace(cfg, block_k=64))
        with pytest.raises(ValueError, match="dividing the group"):
            fp8_block_gemm(x, w, s, block, config=replace(cfg, block_k=256, fused_quant=False))


class TestChannelGemm:
    @pytest.mark.parametrize("m,n,k", SHAPES)
    def test_per_channel_dynamic_matches_reference(self, device, m, n, k, monkeypatch):
        from atom_core.kernels.triton import fp8_gemm
        from atom_core.kernels.triton.fp8_gemm import fp8_channel_gemm

        widen_fp8_dot_on_cuda(monkeypatch, device, fp8_gemm)

        gen = seeded("channel", m, n, k)
        w, s = channel_weight(gen, n, k)
        x, bias = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
        x, w, s, bias = to(device, x, w, s, bias)
        assert rel_err(fp8_channel_gemm(x, w, s, None, bias), fp8_linear_ref(x, w, s, None, bias)) < 1e-5

    @pytest.mark.parametrize("fused", [True, False])
    @pytest.mark.parametrize("split_k", [1, 2])
    def test_static_input_and_per_tensor_weight_scales(self, device, fused, split_k):
        from atom_core.kernels.triton.fp8_gemm import default_fp8_gemm_config, fp8_channel_gemm

        gen = seeded("static", fused, split_k)
        w, _ = channel_weight(gen, 48, 260)
        ws = torch.rand(1, generator=gen) * 1e-2 + 1e-3
        x = torch.randn(3, 260, generator=gen)
        in_s = torch.tensor(x.abs().max().item() / 448 * 1.5)
        cfg = replace(default_fp8_gemm_config(3, 48, 260, None, 4), fused_quant=fused, split_k=split_k)
        x, w, ws, in_s = to(device, x, w, ws, in_s)
        for input_scale in (in_s, None):
            out = fp8_channel_gemm(x, w, ws, input_scale, config=cfg)
            assert rel_err(out, fp8_linear_ref(x, w, ws, input_scale)) < 1e-5

    @pytest.mark.parametrize("fused", [True, False])
    def test_float64_oracle_and_bf16(self, device, fused):
        from atom_core.kernels.triton.fp8_gemm import default_fp8_gemm_config, fp8_channel_gemm

        gen = seeded("oracle", fused)
        w = (torch.randn(40, 300, generator=gen) * 100).clamp(-448, 448).to(FP8_DTYPE)
        ws = torch.rand(40, 1, generator=gen) * 1e-3 + 1e-4
        x = torch.randn(4, 300, generator=gen)
        cfg = replace(default_fp8_gemm_config(4, 40, 300, None, 4), fused_quant=fused)
        want = _oracle_x(x, 300) @ (w.double() * ws.double()).t()
        assert rel_err(fp8_channel_gemm(*to(device, x, w, ws), config=cfg).cpu().double(), want) < 1e-5
        xb = x.bfloat16()
        out = fp8_channel_gemm(*to(device, xb, w, ws), config=cfg)
        assert out.dtype == torch.bfloat16 and rel_err(out, fp8_linear_ref(*to(device, xb, w, ws))) < TOL[torch.bfloat16]

    def test_bad_weight_scale_is_a_clear_error(self):
        from atom_core.kernels.triton.fp8_gemm import fp8_channel_gemm

        w, s = channel_weight(seeded("bad"), 64, 128)
        with pytest.raises(ValueError, match="1 or N=64 values"):
            fp8_channel_gemm(torch.randn(1, 128), w, s[:3])
        with pytest.raises(ValueError, match="float32"):
            fp8_channel_gemm(torch.randn(1, 128), w, s.double())


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, scale, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)[None, :]
    tl.store(q_ptr + offs[None, :], _quantize_tile(x, tl.zeros([1, 1], tl.float32) + scale, 2))


@pytest.mark.skipif(not INTERPRET, reason="checks the interpreter-only rounding (TRITON_INTERPRET=1)")
def test_interpreter_e4m3_rounding_equals_torch_cast():
    """The fused quantizer's arithmetic rounding to the e4m3 grid (used under the interpreter, whose
    float32 -> e4m3 cast is wrong) gives torch's codes: random values over e4m3's range, subnormals,
    exact midpoints between neighbouring codes (ties to even) and the clamp at +-448."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    codes = codes[codes.isfinite()].unique()
    mids = (codes[1:] + codes[:-1]) / 2
    gen = seeded("round")
    x = torch.cat([torch.randn(1000, generator=gen) * 100, torch.rand(200, generator=gen) * 2 ** -6, mids, codes,
                   torch.tensor([500.0, -1000.0, 0.0])])
    x = torch.cat([x, x.new_zeros(4096 - x.numel())])
    q = torch.empty(4096, dtype=FP8_DTYPE)
    _quantize_kernel[(1,)](x, q, 1.0, N=4096)
    assert torch.equal(q.float(), x.clamp(-448, 448).to(FP8_DTYPE).float())


CUDA = torch.device("cuda", 0)  # never touched: the tables read only its type and capability


def as_sm90(monkeypatch, hip: bool = False) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "hip", "6.0" if hip else None)


def table_names(table: KernelTable, ms=(1, 2, 16, 17, 32, 33, 4096)) -> list[str]:
    return [table(m).__name__ for m in ms]


def triton_gemm_tables(monkeypatch) -> None:
    """FP8 layers built from now on run the Triton GEMMs at every M (the GEMV and weight-only GEMM
    tested in their own files): the per-channel GEMM, and the block GEMM."""
    from atom_core.quant import fp8

    monkeypatch.setattr(fp8, "fp8_linear_table", lambda device, n, k, dtype, static: KernelTable(
        ((None, fp8_ops.fp8_triton_gemm),), dtype))
    monkeypatch.setattr(fp8, "fp8_block_linear_table", lambda device, dtype, block: KernelTable(
        ((None, fp8_ops.fp8_block_gemm),), dtype))


class TestDispatch:
    def test_per_channel_tables_on_sm90(self, monkeypatch):
        """Dynamic activations: the GEMV at 1 token, the weight-only GEMM to 32 tokens for outputs of at
        most 8,192 columns (to 16 for wider ones), then _scaled_mm where the shape allows it, else the
        Triton GEMM; a static input_scale keeps _scaled_mm (or the Triton GEMM) at every M."""
        as_sm90(monkeypatch)
        w8a16_to_32 = ["fp8_gemv"] + ["fp8_w8a16"] * 4 + ["fp8_scaled_mm"] * 2
        assert table_names(fp8_linear_table(CUDA, 4096, 4096, torch.bfloat16, False)) == w8a16_to_32
        assert table_names(fp8_linear_table(CUDA, 8192, 4096, torch.float16, False)) == w8a16_to_32
        wide = ["fp8_gemv", "fp8_w8a16", "fp8_w8a16"] + ["fp8_scaled_mm"] * 4
        assert table_names(fp8_linear_table(CUDA, 28672, 4096, torch.bfloat16, False)) == wide
        assert table_names(fp8_linear_table(CUDA, 200, 520, torch.bfloat16, False))[-1] == "fp8_triton_gemm"  # N % 16
        assert table_names(fp8_linear_table(CUDA, 4096, 4096, torch.float32, False))[-1] == "fp8_triton_gemm"
        assert set(table_names(fp8_linear_table(CUDA, 4096, 4096, torch.bfloat16, True))) == {"fp8_scaled_mm"}
        assert set(table_names(fp8_linear_table(CUDA, 4096, 4096, torch.float32, True))) == {"fp8_triton_gemm"}

    def test_per_channel_tables_elsewhere(self, monkeypatch):
        """Before SM89, on the CPU: the reference; on ROCm: _scaled_mm where the shape allows it."""
        assert set(table_names(fp8_linear_table(torch.device("cpu"), 4096, 4096, torch.bfloat16, False))) == {
            "fp8_reference"}
        as_sm90(monkeypatch, hip=True)
        assert set(table_names(fp8_linear_table(CUDA, 4096, 4096, torch.bfloat16, False))) == {"fp8_scaled_mm"}
        assert set(table_names(fp8_linear_table(CUDA, 4096, 4096, torch.float32, False))) == {"fp8_reference"}
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
        monkeypatch.setattr(torch.version, "hip", None)
        assert set(table_names(fp8_linear_table(CUDA, 4096, 4096, torch.bfloat16, False))) == {"fp8_reference"}

    def test_block_tables(self, monkeypatch):
        assert set(table_names(fp8_block_linear_table(torch.device("cpu"), torch.bfloat16, [1, 128]))) == {
            "fp8_block_reference"}
        as_sm90(monkeypatch)
        assert table_names(fp8_block_linear_table(CUDA, torch.bfloat16, [1, 128]), (1, 2, 4096)) == [
            "fp8_block_gemv", "fp8_block_gemm", "fp8_block_gemm"]
        from atom_core.kernels.triton.fp8_gemm import block_gemm_supported

        unsupported = next(b for b in ([1, 96], [1, 48], [1, 100]) if not block_gemm_supported(b))
        assert table_names(fp8_block_linear_table(CUDA, torch.bfloat16, unsupported), (1, 2)) == [
            "fp8_block_gemv", "fp8_block_reference"]

    def test_built_layers_hold_their_table_and_pass_its_key(self, monkeypatch):
        from atom_core.quant.fp8 import Fp8BlockLinearMethod, Fp8OnlineLinearMethod, Fp8ScaledLinearMethod

        seen = []
        real = KernelTable.from_key
        monkeypatch.setattr(KernelTable, "from_key", staticmethod(lambda key: seen.append(int(key)) or real(key)))
        for method in (Fp8BlockLinearMethod((128, 128)), Fp8OnlineLinearMethod(), Fp8ScaledLinearMethod(False, True)):
            layer = torch.nn.Module()
            method.create_weights(layer, input_size=256, output_sizes=[64], weight_loader=None)
            assert isinstance(layer.kernel_table, KernelTable) and layer.kernel_table.dtype == torch.float32
            gen = seeded("layer", type(method).__name__)
            if isinstance(method, Fp8BlockLinearMethod):
                layer.weight.data, layer.weight_scale_inv.data, _ = block_weight(gen, 64, 256)
            else:
                layer.weight.data.copy_(torch.randn(64, 256, generator=gen))
                method.process_weights_after_loading(layer)
                if isinstance(method, Fp8ScaledLinearMethod):
                    layer.weight_scale.data.fill_(0.01)
                    layer.input_scale.data.fill_(0.02)
            method.apply(layer, torch.randn(3, 256, generator=gen))
            assert seen[-1] == id(layer.kernel_table)

    def test_custom_ops_stay_on_the_reference_on_cpu(self):
        gen = seeded("cpu-ops")
        w, s, block = block_weight(gen, 64, 256)
        x = torch.randn(3, 256, generator=gen)
        assert torch.equal(fp8_block_linear(x, w, s, block), fp8_block_linear_ref(x, w, s, block))
        wc, sc = channel_weight(gen, 64, 256)
        assert torch.equal(fp8_linear(x, wc, sc), fp8_linear_ref(x, wc, sc))
        table = fp8_linear_table(torch.device("cpu"), 64, 256, torch.float32, False)
        assert torch.equal(fp8_linear(x, wc, sc, None, None, table.key), fp8_linear_ref(x, wc, sc))
        with pytest.raises(AssertionError, match="made for torch.float32 activations"):
            fp8_linear(x.double(), wc, sc, None, None, table.key)

    def test_ops_compile_with_a_table_key_in_one_graph(self):
        """The key is a graph input: layers with different tables share one compiled graph."""
        gen = seeded("compile")
        wc, sc = channel_weight(gen, 64, 256)
        tables = [fp8_linear_table(torch.device("cpu"), 64, 256, torch.float32, False) for _ in range(2)]
        graphs = []
        torch._dynamo.reset()
        compiled = torch.compile(lambda x, key: fp8_linear(x, wc, sc, None, None, key),
                                 backend=lambda gm, _: graphs.append(gm) or gm, fullgraph=True)
        x = torch.randn(3, 256, generator=gen)
        for table in tables:
            assert torch.equal(compiled(x, table.key), fp8_linear_ref(x, wc, sc))
        assert len(graphs) == 1

    def test_default_tiles(self):
        from atom_core.kernels.triton.fp8_gemm import default_fp8_gemm_config

        cfg = default_fp8_gemm_config(1, 4096, 4096, 128, 132)  # Llama-3-8B o_proj, decode
        assert (cfg.block_m, cfg.fused_quant) == (16, True)
        programs = 4096 // cfg.block_n * cfg.split_k
        assert 132 <= programs <= 4 * 132 and 32 % cfg.split_k == 0  # ~2 per SM, no empty split
        assert default_fp8_gemm_config(1, 576, 7168, 128, 132).split_k > 1  # DeepSeek-V3 kv_a: narrow N
        big = default_fp8_gemm_config(4096, 4096, 4096, None, 132)
        assert (big.split_k, big.fused_quant) == (1, False)
        assert default_fp8_gemm_config(4, 64, 512, 64, 132).block_k == 64


@pytest.mark.skipif(not INTERPRET, reason="runs the Triton GEMM under the interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_engine_through_the_triton_gemm_is_greedy_under_the_reference_path(tmp_path, monkeypatch, quantization):
    """The ops wired into a model: a tiny Llama as a block-FP8 checkpoint, or bf16 with --quantization
    fp8, generates with the Triton GEMMs in every layer's table (interpreter) tokens that are greedy
    under the reference path. Same codes and scales, float32 sums in another order: a last-bit
    difference can flip one activation's e4m3 rounding and a near-tie with it (seen on a 2-core
    runner), so, as in test_fp8_models, the first token must be the reference's and every token's
    reference logit, teacher-forced over our continuation, within FLIP of the reference's best."""
    from atom_core import LLMEngine
    from atom_core.kernels.triton import fp8_gemm
    from tests.models.harness import prompt_logits
    from tests.quant.test_fp8_models import FLIP, GREEDY, _build, prompts, write_block_fp8
    from tests.tiny_models import build_tiny_model

    path = build_tiny_model(tmp_path / "bf16", "llama")
    if quantization is None:
        write_block_fp8(path, tmp_path / "fp8")
        path = tmp_path / "fp8"
    plist = prompts(json.loads((path / "config.json").read_text())["vocab_size"])
    reference = _build(path, quantization)
    want = [o["token_ids"] for o in LLMEngine(str(path), quantization=quantization).generate(plist, GREEDY)]
    calls = []
    for fn in ("fp8_block_gemm", "fp8_channel_gemm"):
        real = getattr(fp8_gemm, fn)
        monkeypatch.setattr(fp8_gemm, fn, lambda *a, _r=real, **kw: calls.append(1) or _r(*a, **kw))
    triton_gemm_tables(monkeypatch)
    got = [o["token_ids"] for o in LLMEngine(str(path), quantization=quantization).generate(plist, GREEDY)]
    assert calls
    for prompt, g, w in zip(plist, got, want):
        assert len(g) == len(w) and g[0] == w[0]
        logits = prompt_logits(reference, prompt + g[:-1])[len(prompt) - 1:]
        chosen = logits.gather(1, torch.tensor(g)[:, None]).squeeze(1)
        assert (logits.max(1).values - chosen).max() < FLIP


def test_bench_refuses_bad_arguments_and_runs_only_on_cuda(monkeypatch):
    from benchmarks.kernels import fp8_bench

    for argv, message in ((["--shapes", "llama-3-8b,mixtral"], "unknown shape"), (["--m", "1,x"], "positive integers"),
                          (["--m", "0"], "positive integers")):
        monkeypatch.setattr("sys.argv", ["fp8_bench", *argv])
        with pytest.raises(SystemExit, match=message):
            fp8_bench.main()
    monkeypatch.setattr("sys.argv", ["fp8_bench"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        fp8_bench.main()


def _clean_env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("ATOM_")}


# ---------------------------------------------------------------------------------------------
# GPU (not run yet: written in a session without one)


def random_fp8(n: int, k: int, block: bool):
    """e4m3 [N, K] spread over e4m3's range with scales making unit-size dot products: block
    (row-expanded [N, ceil(K/128)], block [1, 128]) or per channel ([N, 1])."""
    gen = torch.Generator(device="cuda").manual_seed(n * 31 + k)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 32).to(FP8_DTYPE)
    if not block:
        return w, torch.rand(n, 1, device="cuda", generator=gen) / (32 * k ** 0.5) + 1e-5
    blocks = torch.rand(-(-n // 128), -(-k // 128), device="cuda", generator=gen) + 0.5
    return w, (blocks / (32 * k ** 0.5)).repeat_interleave(128, 0)[:n].contiguous()


def _gpu_shapes():
    from benchmarks.kernels.fp8_bench import SHAPES

    return [pytest.param(model, name, id=f"{model}-{name}") for model, shapes in SHAPES.items() for name in shapes]


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="interpreter mode")
class TestOnCuda:
    @pytest.mark.parametrize("model,name", _gpu_shapes())
    @pytest.mark.parametrize("m", [1, 7, 16, 64, 300])
    def test_model_shapes_match_reference(self, model, name, m):
        """Llama-3-8B's projections per channel (online fp8) and block; DeepSeek-V3's block."""
        from benchmarks.kernels.fp8_bench import SHAPES
        from atom_core.kernels.triton.fp8_gemm import fp8_block_gemm, fp8_channel_gemm

        n, k = SHAPES[model][name]
        x = torch.randn(m, k, device="cuda").bfloat16()
        w, s = random_fp8(n, k, block=True)
        assert rel_err(fp8_block_gemm(x, w, s, [1, 128]), fp8_block_linear_ref(x, w, s, [1, 128])) < TOL[torch.bfloat16]
        if model == "llama-3-8b":
            wc, sc = random_fp8(n, k, block=False)
            assert rel_err(fp8_channel_gemm(x, wc, sc), fp8_linear_ref(x, wc, sc)) < TOL[torch.bfloat16]

    @pytest.mark.parametrize("m", [1, 16, 48])
    def test_replays_in_a_cuda_graph(self, m):
        """No host sync: captured calls (split-K and the split sum included) replay to the eager result."""
        from atom_core.kernels.triton.fp8_gemm import fp8_block_gemm, fp8_channel_gemm

        x = torch.randn(m, 4096, device="cuda").bfloat16()
        wb, sb = random_fp8(4096, 4096, block=True)
        wc, sc = random_fp8(4096, 4096, block=False)
        calls = (lambda: fp8_block_gemm(x, wb, sb, [1, 128]), lambda: fp8_channel_gemm(x, wc, sc))
        for call in calls:
            call()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [call() for call in calls]
        x.copy_(torch.randn_like(x))
        graph.replay()
        for call, out in zip(calls, outs):
            assert torch.equal(out, call())
        assert rel_err(outs[0], fp8_block_linear_ref(x, wb, sb, [1, 128])) < TOL[torch.bfloat16]

    def test_custom_ops_run_the_kernels(self, monkeypatch):
        """fp8_block_linear takes the block GEMM on CUDA above 1 token; fp8_linear takes _scaled_mm above
        32 tokens, the Triton GEMM where its table holds it and for shapes _scaled_mm refuses."""
        from atom_core.kernels.triton import fp8_gemm

        calls = []
        for fn in ("fp8_block_gemm", "fp8_channel_gemm"):
            real = getattr(fp8_gemm, fn)
            monkeypatch.setattr(fp8_gemm, fn, lambda *a, _f=fn, _r=real, **kw: calls.append(_f) or _r(*a, **kw))
        x = torch.randn(3, 512, device="cuda").bfloat16()
        wb, sb = random_fp8(256, 512, block=True)
        assert rel_err(fp8_block_linear(x, wb, sb, [1, 128]), fp8_block_linear_ref(x, wb, sb, [1, 128])) < 2e-2
        assert calls == ["fp8_block_gemm"]
        wc, sc = random_fp8(256, 512, block=False)
        fp8_linear(torch.randn(33, 512, device="cuda").bfloat16(), wc, sc)
        assert calls == ["fp8_block_gemm"]  # scaled_mm above 32 tokens
        triton = KernelTable(((None, fp8_ops.fp8_triton_gemm),), torch.bfloat16)
        assert rel_err(fp8_linear(x, wc, sc, None, None, triton.key), fp8_linear_ref(x, wc, sc)) < 2e-2
        assert calls == ["fp8_block_gemm", "fp8_channel_gemm"]
        wo, so = random_fp8(200, 520, block=False)  # K, N not multiples of 16: _scaled_mm refuses
        xo = torch.randn(40, 520, device="cuda").bfloat16()
        assert rel_err(fp8_linear(xo, wo, so), fp8_linear_ref(xo, wo, so)) < 2e-2 and calls[-1] == "fp8_channel_gemm"

    @pytest.mark.parametrize("quantization", [None, "fp8"])
    def test_tiny_llama_engine_on_cuda_is_near_greedy_on_the_cpu_model(self, tmp_path, quantization, monkeypatch):
        """An engine run on the GPU (graphs on): a tiny Llama as a block-FP8 checkpoint, or its bf16
        checkpoint with --quantization fp8, the Triton GEMMs in every layer's table (float32 x). Oracle: our CPU model of the same files (checked against HF in
        test_fp8_models); each CUDA token must be near-greedy under it (that file's FLIP bound)."""
        from atom_core import LLMEngine
        from tests.models.harness import prompt_logits
        from tests.quant.test_fp8_models import FLIP, GREEDY, _build, prompts, write_block_fp8
        from tests.tiny_models import build_tiny_model

        triton_gemm_tables(monkeypatch)
        path = build_tiny_model(tmp_path / "bf16", "llama")
        if quantization is None:
            write_block_fp8(path, tmp_path / "fp8")
            path = tmp_path / "fp8"
        cpu_model = _build(path, quantization)
        plist = prompts(cpu_model.config.vocab_size)
        engine = LLMEngine(str(path), device="cuda", dtype="float32", num_kv_blocks=512, quantization=quantization)
        for prompt, out in zip(plist, engine.generate(plist, GREEDY)):
            tokens = out["token_ids"]
            logits = prompt_logits(cpu_model, prompt + tokens[:-1])[len(prompt) - 1:]
            chosen = logits.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
            assert (logits.max(1).values - chosen).max() < FLIP


# ---------------------------------------------------------------------------------------------
# offline sm_90 compile


@pytest.mark.skipif(INTERPRET, reason="the interpreter replaces the compiled kernels")
@pytest.mark.parametrize("m,n,k,block", [(1, 4096, 4096, True), (1, 4096, 14336, False), (16, 576, 7168, True),
                                         (32, 4096, 4096, False), (32, 4096, 4096, True), (128, 7168, 2048, True),
                                         (4096, 7168, 16384, True), (4096, 4096, 4096, False)])
def test_gemm_compiles_for_hopper_without_spills(m, n, k, block):
    """The GEMM compiles for sm_90 with Triton's bundled toolchain (no GPU needed) at each default tile
    tier (fused quantization at M <= 16, split partials where the tier splits), with 16-byte weight
    loads (cp.async) and no local-memory spills. Pointers and row strides carry the 16-divisibility
    Triton gives them at launch (else loads stay scalar)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from atom_core.kernels.triton import fp8_gemm
    from tests.kernels.sm90_compile import cuobjdump_path, stack_bytes

    if cuobjdump_path() is None:
        pytest.skip("Triton ships no cuobjdump here")
    fn = fp8_gemm._fp8_gemm_kernel
    cfg = fp8_gemm.default_fp8_gemm_config(m, n, k, 128 if block else None, 132)
    quant = fp8_gemm.QUANT_DYNAMIC if cfg.fused_quant else fp8_gemm.QUANT_NONE
    strides = ("stride_xm", "stride_xsm", "stride_xsk", "stride_wn", "stride_wsn", "stride_wsk", "stride_om", "stride_os")
    sig = {"x_ptr": "*bf16" if cfg.fused_quant else "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv",
           "ws_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*fp32" if cfg.split_k > 1 else "*bf16", "M": "i32",
           "steps_per_split": "i32", "min_scale": "fp32", **{s: "i32" for s in strides}}
    consts = dict(N=n, K=k, GROUP=128 if block else k, SCALE_BN=1, PER_GROUP=block, QUANT=quant, HAS_BIAS=False,
                  IS_SPLIT=cfg.split_k > 1, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  GROUP_M=cfg.group_m, DOT_MODE=0)
    aligned = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items()
               if t.startswith("*") or a in ("stride_xm", "stride_wn", "stride_om", "stride_os")}
    src = ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in consts}}, constexprs=consts, attrs=aligned)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    assert "cp.async.cg.shared.global" in kernel.asm["ptx"], "weight tiles should stream with 16-byte copies"
    assert stack_bytes(kernel) == 0
