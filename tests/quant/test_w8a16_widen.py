"""The PTX widening of the weight-only FP8 GEMM (`kernels/triton/fp8_w8a16.py`, ATOM_W8A16_WIDEN=ptx).

- CPU: the kernel's own WIDEN_ASM, run by a numpy interpreter of its instructions (`_run_widen`): all
  256 e4m3 bytes widen to the e4m3 value * 2**-WIDEN_EXP exactly, in every byte position of a word
  (element i in byte i -> half i % 2 of output i // 2); the NaN bytes become finite; a GEMM emulated
  through the PTX, products below float32's normal range flushed (the worst the tensor cores may do),
  lands within the GPU tolerance of `fp8_gemv_ref` at rms(x) 1 and 1e-3; the switch (env, setter,
  which kernel a launch takes);
- offline sm_90 compiles of `_w8a16_ptx_kernel` at the default tiles: no spills, the widening in the
  K loop (no F2F), the loop's SASS per weight under a bound and under the convert kernel's;
- GPU (marker `gpu`): against `fp8_gemv_ref` on Llama-3-8B's shapes at M 2/8/32/64, per-channel and
  per-tensor scales, bias, forced split-K, small-x rows; `fp8_linear` under ATOM_FP8_SMALL_M_KERNEL=w8a16
  with ATOM_W8A16_WIDEN=ptx.

    python -m pytest tests/quant/test_w8a16_widen.py -q
    python -m pytest -m gpu tests/quant/test_w8a16_widen.py -q      (not yet run: written without a GPU)

Tolerance: as tests/quant/test_fp8_w8a16.py's Llama-shape test (4e-3 relative L2): the same bf16
products and float32 sums as the convert kernel, times an exact power of two. The emulation rounds to
the reference's bf16 outputs exactly at rms(x) 1 and lands 1.4e-4 from them at rms(x) 1e-3 with every
product under float32's normal range flushed (0.24% of them; at rms(x) 1e-5, 12%: 1e-2).
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from atom_core.envs import read_envs
from atom_core.kernels.triton import fp8_w8a16 as k8
from atom_core.kernels.triton.fp8_gemv import fp8_gemv_ref
from atom_core.quant.fp8_ops import FP8_DTYPE
from tests.kernels.import_switch import run_with_env
from tests.kernels.tolerances import INTERPRET, rel_err
from tests.quant.test_fp8_gemm import channel_weight, seeded
from tests.quant.test_w4a16_f16x2 import _lop3

GPU_TOL = 4e-3
F32_MIN_NORMAL = 2.0 ** -126
FP16_NAN = 0x7FFF  # PTX's canonical fp16 NaN: what the emulated cvt gives for the e4m3 NaNs


# ---------------------------------------------------------------------------------------------
# a numpy interpreter of WIDEN_ASM (registers: uint32 arrays)


def _e4m3_to_f16_bits(nan_bits: int = FP16_NAN) -> np.ndarray:
    """cvt's table: e4m3 byte -> fp16 bits (torch's exact conversion; NaN -> nan_bits)."""
    f16 = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).to(torch.float16)
    bits = f16.view(torch.int16).numpy().view(np.uint16).astype(np.uint32)
    bits[f16.isnan().numpy()] = nan_bits
    return bits


def _run_widen(words: np.ndarray, nan_bits: int = FP16_NAN) -> tuple[np.ndarray, np.ndarray]:
    """WIDEN_ASM on 32-bit words (4 e4m3 bytes each) -> its two outputs ($0, $1)."""
    table = _e4m3_to_f16_bits(nan_bits)
    regs: dict[str, np.ndarray] = {"$2": np.asarray(words, dtype=np.uint32)}

    def val(tok: str) -> np.ndarray:
        return regs[tok] if tok in regs else np.full(regs["$2"].shape, int(tok, 0), dtype=np.uint32)

    for stmt in k8.WIDEN_ASM.value.strip("{}\n").split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, args = stmt.split(None, 1)
        if op == "mov.b32" and args.startswith("{"):  # unpack: the first name takes the low 16 bits
            lo, hi, src = re.match(r"\{(\w+), (\w+)\}, (\S+)", args).groups()
            regs[lo], regs[hi] = val(src) & 0xFFFF, val(src) >> 16
            continue
        d, *a = [t.strip() for t in args.split(",")]
        if op == "cvt.rn.f16x2.e4m3x2":  # low byte -> low half
            regs[d] = table[val(a[0]) & 0xFF] | table[(val(a[0]) >> 8) & 0xFF] << 16
        elif op == "shr.b32":
            regs[d] = val(a[0]) >> np.uint32(int(a[1], 0))
        elif op == "and.b32":
            regs[d] = val(a[0]) & val(a[1])
        elif op == "lop3.b32":
            regs[d] = _lop3(val(a[0]), val(a[1]), val(a[2]), int(a[3], 0))
        else:
            raise AssertionError(f"the interpreter does not know {op!r}")
    return regs["$0"], regs["$1"]


def _bf16_values(bits: np.ndarray) -> np.ndarray:
    """16-bit bf16 patterns -> float64 (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _widen(w: torch.Tensor) -> np.ndarray:
    """e4m3 [N, K] (K % 4 == 0) -> the emulated kernel's bf16 operand as float64 [N, K]: 4 consecutive
    elements a word, element i in byte i (how Triton packs pack=4), output j holding elements 2j, 2j+1."""
    words = w.contiguous().view(torch.uint8).numpy().view(np.uint32)  # [N, K / 4], little-endian
    out0, out1 = _run_widen(words)
    halves = np.stack([out0 & 0xFFFF, out0 >> 16, out1 & 0xFFFF, out1 >> 16], axis=-1)  # [N, K / 4, 4]
    return _bf16_values(halves).reshape(w.shape)


def _e4m3_values() -> np.ndarray:
    return torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float().numpy().astype(np.float64)


class TestPtx:
    def test_every_e4m3_byte_widens_to_its_value_times_2_pow_minus_112_in_every_position(self):
        rng = np.random.default_rng(0)
        values = np.arange(256, dtype=np.uint32)
        finite = ~np.isnan(_e4m3_values())
        want = _e4m3_values() * 2.0 ** -k8.WIDEN_EXP
        for pos in range(4):
            others = rng.integers(0, 2**32, 256, dtype=np.uint32) & ~(np.uint32(0xFF) << np.uint32(8 * pos))
            out0, out1 = _run_widen(others | values << np.uint32(8 * pos))
            half = (out0, out1)[pos // 2] >> np.uint32(16 * (pos % 2)) & 0xFFFF
            got = _bf16_values(half)
            np.testing.assert_array_equal(got[finite], want[finite], err_msg=f"byte {pos}")
            np.testing.assert_array_equal(np.signbit(got[finite]), np.signbit(want[finite]))  # -0 stays -0
        assert (np.abs(want[finite][want[finite] != 0]) >= 2.0 ** -126).all()  # bf16 normals: no subnormal operand

    @pytest.mark.parametrize("nan_bits", [FP16_NAN, 0x7E00, 0xFE00, 0x7C01, 0xFFFF])
    def test_nan_bytes_become_finite_whatever_fp16_nan_the_cvt_gives(self, nan_bits):
        """e4m3fn NaN is 0x7F / 0xFF; any fp16 NaN read this way is bf16 exponent 31: a finite weight of
        magnitude [2**16, 2**17) once unscaled (checkpoints hold none: quantizers saturate at 448)."""
        out0, _ = _run_widen(np.array([0x00007F7F, 0x0000FFFF], dtype=np.uint32), nan_bits)
        got = _bf16_values(np.stack([out0 & 0xFFFF, out0 >> 16])) * 2.0 ** k8.WIDEN_EXP
        assert np.isfinite(got).all() and ((np.abs(got) >= 2.0**16) & (np.abs(got) < 2.0**17)).all(), got

    def test_the_shift_leaks_nothing_across_lanes(self):
        """MAGNITUDE clears what the 32-bit shift moves from a lane's top into the lane below, for any
        fp16 pattern (not only those an e4m3 gives): each lane is (sign, (h & 0x7FFF) >> 3)."""
        rng = np.random.default_rng(1)
        h = rng.integers(0, 2**32, 4096, dtype=np.uint32)
        s = (h >> np.uint32(k8.SHIFT)) & np.uint32(k8.MAGNITUDE)
        got = _lop3(h, np.full_like(h, k8.SIGNS), s, k8.LOP3_AND_OR)
        for lane in (0, 16):
            lane_h = (h >> np.uint32(lane)) & 0xFFFF
            want = (lane_h & 0x8000) | ((lane_h & 0x7FFF) >> 3)
            np.testing.assert_array_equal((got >> np.uint32(lane)) & 0xFFFF, want)

    @pytest.mark.parametrize("x_rms", [1.0, 1e-3])
    @pytest.mark.parametrize("per_tensor", [False, True])
    def test_emulated_gemm_is_within_the_gpu_tolerance(self, x_rms, per_tensor):
        """The kernel's products (bf16 x times the widened weight, exact in float64) with those below
        float32's normal range flushed, summed, times scale * 2**112 in float32, rounded to bf16."""
        m, n, k = 8, 96, 1024
        gen = seeded("w8a16-widen", x_rms, per_tensor)
        w, s = channel_weight(gen, n, k)
        if per_tensor:
            s = s.max().reshape(1)
        x = (torch.randn(m, k, generator=gen) * x_rms).to(torch.bfloat16)
        prods = x.double().numpy()[:, None, :] * _widen(w)[None, :, :]  # [M, N, K]
        flushed = np.abs(prods) < F32_MIN_NORMAL
        acc = np.where(flushed, 0.0, prods).sum(-1).astype(np.float32)
        scale = (s.float().reshape(-1) * np.float32(2.0 ** k8.WIDEN_EXP)).numpy()
        assert np.isfinite(scale).all()
        y = torch.from_numpy(acc * scale).to(torch.bfloat16)
        err = rel_err(y, fp8_gemv_ref(x, w, s))
        assert err < GPU_TOL / 1.5, err
        if x_rms < 1:  # the case exercises the flush: some products fall under it, and cost nothing
            assert flushed.any() and flushed.mean() < 1e-2, flushed.mean()


class TestSwitch:
    def test_env_var_and_setter(self, monkeypatch):
        assert read_envs({}).w8a16_widen == "convert"
        assert read_envs({"ATOM_W8A16_WIDEN": "PTX"}).w8a16_widen == "ptx"
        with pytest.raises(ValueError, match="invalid ATOM_W8A16_WIDEN='asm'; expected one of: convert, ptx"):
            read_envs({"ATOM_W8A16_WIDEN": "asm"})
        with pytest.raises(ValueError, match="unknown W8A16 widening 'asm'; expected one of: convert, ptx"):
            k8.set_w8a16_widen("asm")
        monkeypatch.setattr(k8, "_widen_kind", k8._widen_kind)  # restored after the setter below
        k8.set_w8a16_widen("ptx")
        assert k8._widen_kind == "ptx"

    def test_the_import_reads_the_env(self):
        code = "from atom_core.kernels.triton import fp8_w8a16 as k; print(k._widen_kind)"
        run = run_with_env(code, "ATOM_W8A16_WIDEN", "ptx")
        assert run.stdout.strip() == "ptx", run.stderr
        bad = run_with_env(code, "ATOM_W8A16_WIDEN", "fast")
        assert bad.returncode != 0 and "invalid ATOM_W8A16_WIDEN='fast'" in bad.stderr

    def test_ptx_only_for_bf16_x_on_cuda(self, monkeypatch):
        monkeypatch.setattr(k8, "_widen_kind", "convert")
        assert k8._kernel_for(torch.bfloat16, interpret=False) is k8._w8a16_kernel
        monkeypatch.setattr(k8, "_widen_kind", "ptx")
        assert k8._kernel_for(torch.bfloat16, interpret=False) is k8._w8a16_ptx_kernel
        assert k8._kernel_for(torch.bfloat16, interpret=True) is k8._w8a16_kernel  # no inline asm there
        assert k8._kernel_for(torch.float16, interpret=False) is k8._w8a16_kernel
        assert k8._kernel_for(torch.float32, interpret=False) is k8._w8a16_kernel


# ---------------------------------------------------------------------------------------------
# offline sm_90 compiles

# Loop SASS instructions per weight at the default tiles (N 4096, K 14336), by M. Measured (Triton
# 3.9): ptx 4.17 / 4.17 / 4.08 / 4.77 at M 2 / 8 / 32 / 64; convert 4.84 / 4.84 / 5.84 / 4.83. Both
# widen in 2 instructions a weight; the drop at M <= 32 is the operand layout (the asm is not pure,
# so the dot keeps bf16's kWidth 2: x by ldmatrix instead of LDS.64 + moves).
INSTRUCTIONS_A_WEIGHT = {2: 4.3, 8: 4.3, 32: 4.2, 64: 4.9}


def _compile_sm90(fn, m: int, **consts):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    bm, bn, bk, _, warps, stages = k8.default_tiles(m, 4096, 14336, 132, 2)
    out = "*fp32" if consts.get("IS_SPLIT", True) else "*bf16"
    sig = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": out,
           **{a: "i32" for a in ("M", "N", "K", "steps_per_split", "stride_xm", "stride_wn", "stride_ws",
                                 "stride_om", "stride_os")}}
    aligned = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items()
               if t.startswith("*") or a.startswith("stride") or a in ("N", "K")}
    consts = dict(dict(HAS_BIAS=False, IS_SPLIT=True, MASK_K=False, IEEE=False), **consts, BLOCK_M=bm, BLOCK_N=bn,
                  BLOCK_K=bk)
    src = ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in consts}}, constexprs=consts, attrs=aligned)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    return kernel, bn * bk / (32 * warps)  # weights a thread a step


def _needs_cuobjdump():
    from tests.kernels.sm90_compile import cuobjdump_path

    if INTERPRET:
        pytest.skip("the interpreter replaces the compiled kernels")
    if cuobjdump_path() is None:
        pytest.skip("Triton ships no cuobjdump here")


@pytest.mark.parametrize("m", [2, 8, 32, 64])
def test_ptx_kernel_compiles_for_hopper_in_fewer_instructions_a_weight(m):
    from tests.kernels.sm90_compile import loop_sass, stack_bytes

    _needs_cuobjdump()
    kernel, weights = _compile_sm90(k8._w8a16_ptx_kernel, m)
    assert stack_bytes(kernel) == 0
    loop = loop_sass(kernel)
    assert not any(op.startswith("F2F.") for op in loop), "Triton's widening in the PTX kernel"
    assert sum(op.startswith("F2FP.F16.E4M3") for op in loop) == weights / 2  # one cvt a weight pair
    convert = loop_sass(_compile_sm90(k8._w8a16_kernel, m)[0])
    assert len(loop) / weights < INSTRUCTIONS_A_WEIGHT[m], f"{len(loop) / weights:.2f} a weight"
    assert len(loop) <= len(convert), (len(loop), len(convert))


def test_masked_and_bias_variants_compile_for_hopper():
    from tests.kernels.sm90_compile import stack_bytes

    _needs_cuobjdump()
    for m, consts in ((32, dict(MASK_K=True)), (8, dict(IS_SPLIT=False, HAS_BIAS=True)),
                      (64, dict(IS_SPLIT=False, HAS_BIAS=True, MASK_K=True))):
        assert stack_bytes(_compile_sm90(k8._w8a16_ptx_kernel, m, **consts)[0]) == 0, (m, consts)


# ---------------------------------------------------------------------------------------------
# GPU (not run yet: written in a session without one)

LLAMA_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down


def _case(m: int, n: int, k: int, seed: int, x_rms: float = 1.0, per_tensor: bool = False):
    """As test_fp8_w8a16's Llama-shape case: e4m3 weights spanning the format, per-channel scales."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 32).to(FP8_DTYPE)
    s = torch.rand(n, 1, device="cuda", generator=gen) / (32 * k ** 0.5) + 1e-5
    x = (torch.randn(m, k, device="cuda", generator=gen) * x_rms).to(torch.bfloat16)
    return x, w, (s.max().reshape(1) if per_tensor else s)


def _count_launches(monkeypatch) -> list:
    """The kernels fp8_w8a16_gemm launches from now on (what `_kernel_for` hands it; no Triton internals)."""
    chosen, pick = [], k8._kernel_for
    monkeypatch.setattr(k8, "_kernel_for", lambda *a, **kw: chosen.append(pick(*a, **kw)) or chosen[-1])
    return chosen


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs CUDA")
class TestOnGpu:
    @pytest.fixture(autouse=True)
    def _ptx_on(self, monkeypatch):
        monkeypatch.setattr(k8, "_widen_kind", "ptx")

    @pytest.mark.parametrize("per_tensor", [False, True])
    @pytest.mark.parametrize("m", [2, 8, 32, 64])
    @pytest.mark.parametrize("n, k", LLAMA_SHAPES)
    def test_matches_the_reference_on_llama_shapes(self, n, k, m, per_tensor, monkeypatch):
        x, w, s = _case(m, n, k, m * 7 + n, per_tensor=per_tensor)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if m in (8, 64) else None
        launched = _count_launches(monkeypatch)
        out = k8.fp8_w8a16_gemm(x, w, s, bias)
        assert rel_err(out, fp8_gemv_ref(x, w, s, None, bias)) < GPU_TOL
        assert launched == [k8._w8a16_ptx_kernel]  # the PTX kernel ran

    @pytest.mark.parametrize("split_k", [1, 3, 8])
    def test_forced_splits(self, split_k):
        x, w, s = _case(32, 4096, 14336, split_k)
        bias = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
        assert rel_err(k8.fp8_w8a16_gemm(x, w, s, bias, split_k=split_k), fp8_gemv_ref(x, w, s, None, bias)) < GPU_TOL

    @pytest.mark.parametrize("m", [2, 32])
    def test_small_x_rows_keep_their_precision(self, m):
        """Rows at rms 1e-3 next to rows at rms 1, each row checked: flushed products (|x w| < 2**-14
        in e4m3 units) stay far inside the tolerance."""
        x, w, s = _case(m, 4096, 4096, 11)
        x[1::2] *= 1e-3
        out, ref = k8.fp8_w8a16_gemm(x, w, s), fp8_gemv_ref(x, w, s)
        for row in range(m):
            assert rel_err(out[row], ref[row]) < GPU_TOL, row

    def test_fp16_x_takes_the_convert_kernel(self):
        x, w, s = _case(8, 4096, 4096, 5)
        assert k8._kernel_for(torch.float16, interpret=False) is k8._w8a16_kernel
        assert rel_err(k8.fp8_w8a16_gemm(x.half(), w, s), fp8_gemv_ref(x.half(), w, s)) < GPU_TOL


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_linear_takes_the_ptx_kernel_under_the_env_switch():
    code = (
        "import torch\n"
        "from atom_core.kernels.triton import fp8_w8a16 as k\n"
        "from atom_core.kernels.triton.fp8_gemv import fp8_gemv_ref\n"
        "from atom_core.quant.fp8_ops import fp8_linear, set_small_m_kernel\n"
        "set_small_m_kernel('w8a16')\n"
        "w = (torch.randn(6144, 4096, device='cuda') * 32).to(torch.float8_e4m3fn)\n"
        "s = torch.rand(6144, 1, device='cuda') / 2048 + 1e-5\n"
        "x = torch.randn(32, 4096, device='cuda', dtype=torch.bfloat16)\n"
        "chosen, pick = [], k._kernel_for\n"
        "k._kernel_for = lambda *a, **kw: chosen.append(pick(*a, **kw)) or chosen[-1]\n"
        "y, ref = fp8_linear(x, w, s), fp8_gemv_ref(x, w, s)\n"
        "runs = sum(kern is k._w8a16_ptx_kernel for kern in chosen)\n"
        "print(runs, ((y.float() - ref.float()).norm() / ref.float().norm()).item())\n")
    run = run_with_env(code, "ATOM_W8A16_WIDEN", "ptx")
    assert run.returncode == 0, run.stderr
    runs, err = run.stdout.split()
    assert int(runs) == 1 and float(err) < GPU_TOL, run.stdout
