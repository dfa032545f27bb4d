"""The packed-half2 W4A16 GEMV (`kernels/triton/w4a16_gemv_f16x2.py`) and where it runs.

- CPU: the kernel's own inline PTX, run by a small numpy interpreter of the instructions it uses
  (`_run_ptx`): the dequant gives (u - 8) * 2**-W_EXP exactly for every nibble value in every
  position, the x pairs are the right values in the right halves, a chunk meets the columns of its
  nibbles (exact sums on small-integer x), and the whole GEMV emulated through the PTX lands
  within the GPU tests' tolerance of `w4a16_gemm_ref`; which layouts and dtypes take it;
- offline sm_90 compiles of every tile: no spills, no layout change in the K loop, and the loop's
  SASS instructions per weight it loads under a bound (the float32 GEMV's: 5.1-5.8 at M = 1);
- GPU (marker `gpu`): against `w4a16_gemm_ref` on Llama-3-8B's shapes and odd ones, M 1-4,
  bf16/fp16, group sizes 32/64/128 and per channel, bias, every tile, split-K, CUDA-graph replay,
  and `atom::w4a16_gemm` running it.

    python -m pytest tests/quant/test_w4a16_f16x2.py -q
    python -m pytest -m gpu tests/quant/test_w4a16_f16x2.py -q          (H100, 2026-11-26: 32 bf16 + 26 fp16 passed)

Tolerance (GPU_TOL, relative L2): the reference rounds each dequantized weight to x's dtype and the
output once; the kernel keeps the weight exact, rounds each fp16 product and half2 add (2**-11
relative, <= 32 terms a sum) and the output once. The emulation measures 5.5e-4 from the exact
product (9e-4 when rms(x) = 1e-3: subnormal products), so from the reference 2.2-2.5e-3 in bf16
(the reference's own bf16 roundings: 2.1e-3 from exact) and 6-7e-4 in fp16 (1e-3 at rms 1e-3);
GPU_TOL leaves 2x over that.
"""
from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
import torch

from atom_core.kernels.triton import w4a16
from atom_core.kernels.triton import w4a16_gemv_f16x2 as f16x2
from atom_core.quant.int_ops import INT4_INTERLEAVE, interleave_int4, pack_int4, w4a16_gemm_ref
from tests.kernels.tolerances import INTERPRET, rel_err

GPU_TOL = {torch.bfloat16: 6e-3, torch.float16: 2.5e-3}


# ---------------------------------------------------------------------------------------------
# a numpy interpreter of the PTX the kernel inlines (registers: uint32 / uint16 arrays)


def _halves(r: np.ndarray) -> np.ndarray:
    """32-bit registers -> their fp16 halves [..., (low, high)]."""
    return np.ascontiguousarray(r, dtype=np.uint32).view(np.uint16).reshape(*r.shape, 2).view(np.float16)


def _pack(h: np.ndarray) -> np.ndarray:
    bits = h.astype(np.float16).view(np.uint16).astype(np.uint32)  # [..., (low, high)]
    return bits[..., 0] | bits[..., 1] << 16


def _f16(bits: np.ndarray) -> np.ndarray:
    return bits.astype(np.uint16).view(np.float16)


def _fma16(a, b, c):
    """Correctly rounded fp16 a * b + c: float64 holds the product exactly and the sum exactly or
    with an error far below fp16's last bit."""
    with np.errstate(over="ignore"):
        return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float16)


def _lop3(a, b, c, lut: int) -> np.ndarray:
    """PTX lop3: bit i of the result is bit (4 a_i + 2 b_i + c_i) of lut (a = 0xF0, b = 0xCC, c = 0xAA)."""
    out = np.zeros_like(a)
    for k in range(8):
        if lut >> k & 1:
            ma, mb, mc = (a if k & 4 else ~a), (b if k & 2 else ~b), (c if k & 1 else ~c)
            out |= ma & mb & mc
    return out


def _prmt(a, b, sel: int) -> np.ndarray:
    """PTX prmt (default mode): byte n of d is byte sel[4n + 2 : 4n] of {b, a} (a = bytes 0-3)."""
    both = (b.astype(np.uint64) << 32) | a.astype(np.uint64)
    out = np.zeros_like(a)
    for n in range(4):
        src = sel >> (4 * n) & 7
        out |= (((both >> np.uint64(8 * src)) & np.uint64(0xFF)).astype(np.uint32)) << np.uint32(8 * n)
    return out


def _run_ptx(asm: str, num_outputs: int, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """Run `asm` (operands $0.. outputs, then inputs, as tl.inline_asm_elementwise numbers them)."""
    regs: dict[str, np.ndarray] = {f"${num_outputs + i}": np.asarray(v).astype(np.uint32) for i, v in enumerate(inputs)}

    def val(tok: str) -> np.ndarray:
        if tok in regs:
            return regs[tok]
        return np.full(inputs[0].shape, int(tok, 0), dtype=np.uint32)

    for stmt in asm.replace("{\n", "\n").replace("\n}", "\n").split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, args = stmt.split(None, 1)
        if op == "mov.b32" and args.startswith("{"):  # unpack a register into its 16-bit halves
            lo, hi, src = re.match(r"\{(\w+), (\w+)\}, (\S+)", args).groups()
            regs[lo], regs[hi] = val(src) & 0xFFFF, val(src) >> 16
            continue
        d, *a = [t.strip() for t in args.split(",")]
        if op == "mov.b32":
            regs[d] = val(a[0])
        elif op == "shr.u32":
            regs[d] = val(a[0]) >> np.uint32(int(a[1], 0))
        elif op == "shl.b32":
            regs[d] = val(a[0]) << np.uint32(int(a[1], 0))
        elif op == "and.b32":
            regs[d] = val(a[0]) & val(a[1])
        elif op == "lop3.b32":
            regs[d] = _lop3(val(a[0]), val(a[1]), val(a[2]), int(a[3], 0))
        elif op == "prmt.b32":
            regs[d] = _prmt(val(a[0]), val(a[1]), int(a[2], 0))
        elif op == "fma.rn.f16x2":
            regs[d] = _pack(_fma16(_halves(val(a[0])), _halves(val(a[1])), _halves(val(a[2]))))
        elif op == "mul.rn.f16x2":
            regs[d] = _pack(_fma16(_halves(val(a[0])), _halves(val(a[1])), np.zeros_like(_halves(val(a[0])))))
        elif op == "cvt.rn.f16x2.f32":  # the first source goes to the high half
            hi, lo = (val(t).view(np.float32).astype(np.float16) for t in a)
            regs[d] = _pack(np.stack([lo, hi], axis=-1))
        elif op == "add.rn.f16":
            regs[d] = _fma16(_f16(val(a[0])), np.ones(1, np.float16), _f16(val(a[1]))).view(np.uint16).astype(np.uint32)
        elif op == "cvt.f32.f16":
            regs[d] = _f16(val(a[0])).astype(np.float32).view(np.uint32)
        else:
            raise AssertionError(f"the interpreter does not know {op!r}")
    return [regs[f"${i}"] for i in range(num_outputs)]


def _dequant(words: np.ndarray) -> list[np.ndarray]:
    return _run_ptx(f16x2.DEQUANT_ASM.value, 4, [words])


def _x_pairs(a: np.ndarray, b: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """X_PAIR asm on 16-bit x values a, b [..., n] (n even), two elements an asm as the kernel packs them."""
    asm = (f16x2.X_PAIR_F16_ASM if dtype == torch.float16 else f16x2.X_PAIR_BF16_ASM).value
    ra, rb = (v[..., 0::2].astype(np.uint32) | v[..., 1::2].astype(np.uint32) << 16 for v in (a, b))
    out0, out1 = _run_ptx(asm, 2, [ra, rb])
    return np.stack([out0, out1], axis=-1).reshape(a.shape)


def _bits16(x: torch.Tensor) -> np.ndarray:
    return x.contiguous().view(torch.int16).numpy().view(np.uint16)


def _emulate_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group: int,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's arithmetic on the CPU: its PTX on every word and x pair, its chunk chains (the
    DOT_ASM operand order of `_row_step`), float32 scale and sum; y in float32 (before the
    kernel's rounding to x's dtype)."""
    m, k = x.shape
    n, num_chunks = qweight.shape[0], k // 32
    words = qweight.numpy().view(np.uint32).reshape(n, num_chunks, 4)  # [N, chunk, word i]
    w = _dequant(words)  # 4 x [N, chunk, i]: dequant output J
    cols = np.arange(num_chunks)[:, None] * 32 + np.arange(4)[None, :]  # nibble 0's column of word i
    xb = _bits16(x)
    out = np.zeros((m, n), dtype=np.float32)
    scale = scales.float().numpy()[:, (np.arange(num_chunks) * 32) // group]  # [N, chunk]
    for row in range(m):
        xp = [_x_pairs(xb[row][cols + lo], xb[row][cols + hi], x.dtype) for lo, hi in f16x2.X_OFFSETS]  # [chunk, i]
        wargs = [np.broadcast_to(w[j][..., i], (n, num_chunks)) for i in range(4) for j in range(4)]
        xargs = [np.broadcast_to(xp[j][..., i], (n, num_chunks)) for i in range(4) for j in range(4)]
        part = _run_ptx(f16x2.DOT_ASM.value, 1, wargs + xargs)[0].view(np.float32)
        out[row] = (part.astype(np.float64) * scale).astype(np.float32).sum(1) * 2.0 ** f16x2.W_EXP
    y = torch.from_numpy(out)
    return y if bias is None else y + bias.float()


def _case(n: int, k: int, group: int, dtype: torch.dtype, seed: int = 0, x_scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 0.005).to(dtype)
    x = (torch.randn(4, k, generator=g) * x_scale).to(dtype)
    return u, pack_int4(u, 1), scales, x


class TestPtx:
    def test_dequant_gives_u_minus_8_for_every_nibble_in_every_position(self):
        rng = np.random.default_rng(0)
        values = np.arange(16, dtype=np.uint32)
        # every value at every position (the other nibbles random), and random words with the sign bit
        placed = [(rng.integers(0, 2**32, (8, 16), dtype=np.uint32) & ~(np.uint32(15) << np.uint32(4 * p)))
                  | (values << np.uint32(4 * p)) for p in range(8)]
        words = np.concatenate(placed + [rng.integers(0, 2**32, 4096, dtype=np.uint32)], axis=None)
        nibbles = (words[:, None] >> (4 * np.arange(8, dtype=np.uint32))) & 15  # [word, nibble]
        for j, (lo, hi) in enumerate(f16x2.NIBBLE_PAIRS):
            got = _halves(_dequant(words)[j]).astype(np.float64)
            want = (nibbles[:, [lo, hi]].astype(np.float64) - 8) * 2.0 ** -f16x2.W_EXP
            np.testing.assert_array_equal(got, want, err_msg=f"dequant output {j}")
        assert sorted(sum(f16x2.NIBBLE_PAIRS, ())) == list(range(8))

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_x_pairs_hold_the_fp16_values_first_element_low(self, dtype):
        g = torch.Generator().manual_seed(1)
        a, b = (torch.randn(2, 64, generator=g) * 10.0 ** torch.randint(-4, 4, (2, 64), generator=g)).to(dtype)
        a[:4] = torch.tensor([0.0, -0.0, 65280.0, 2.0**-20])  # zeros, near the top, a subnormal in fp16
        pairs = _halves(_x_pairs(_bits16(a), _bits16(b), dtype))
        np.testing.assert_array_equal(pairs[..., 0], a.float().numpy().astype(np.float16))
        np.testing.assert_array_equal(pairs[..., 1], b.float().numpy().astype(np.float16))

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_a_chunk_meets_the_columns_of_its_nibbles(self, dtype):
        """Small-integer x and unit scales: every product and half2 sum is exact, so the emulated
        kernel must equal sum (u - 8) x exactly: a nibble meeting the wrong column would not."""
        n, k = 8, 128
        u, qweight, _, _ = _case(n, k, k, dtype)
        x = torch.randint(-3, 4, (2, k)).to(dtype)
        scales = torch.ones(n, 1, dtype=dtype)
        y = _emulate_gemv(x, interleave_int4(qweight, INT4_INTERLEAVE), scales, k)
        assert torch.equal(y.double(), x.double() @ (u.double() - 8).t())
        assert y.abs().max() > 100  # not trivially zero

    def test_the_largest_chunk_sum_stays_finite(self):
        """32 products of |x| = 2**15 and weight -8, one sign: the half2 chain peaks at 2**15 (W_EXP)."""
        n, k = 4, 32
        qweight = torch.zeros(n, k // 8, dtype=torch.int32)  # u = 0: weight -8
        x = torch.full((1, k), 2.0**15, dtype=torch.float16)
        y = _emulate_gemv(x, qweight, torch.ones(n, 1, dtype=torch.float16), k)
        assert torch.equal(y, torch.full((1, n), -8 * 32 * 2.0**15))

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("group, x_scale", [(128, 1.0), (32, 1e-2), (64, 30.0), (512, 1.0), (128, 1e-3)])
    def test_emulated_gemv_is_within_the_gpu_tolerance(self, dtype, group, x_scale):
        """Measured: bf16 2.2-2.5e-3 (the reference's own bf16 roundings: 2.1e-3 from exact), fp16
        6-7e-4, 1e-3 at rms(x) = 1e-3 (fp16 subnormal products)."""
        n, k = 96, 512
        u, qweight, scales, x = _case(n, k, group, dtype, seed=group, x_scale=x_scale)
        bias = (torch.randn(n) * x_scale).to(dtype)
        ref = w4a16_gemm_ref(x, qweight, scales, None, group, bias)
        y = _emulate_gemv(x, interleave_int4(qweight, INT4_INTERLEAVE), scales, group, bias).to(dtype)
        assert rel_err(y, ref) < GPU_TOL[dtype] / 2, rel_err(y, ref)


class TestWhereItRuns:
    def test_f16x2_only_for_symmetric_kernel_layout_half_x(self):
        consts = dict(V=INT4_INTERLEAVE, HAS_ZERO=False)
        assert w4a16._tuned_gemv(torch.bfloat16, consts) is f16x2._w4a16_gemv_f16x2_tuned
        assert w4a16._tuned_gemv(torch.float16, consts) is f16x2._w4a16_gemv_f16x2_tuned
        assert w4a16._tuned_gemv(torch.float32, consts) is w4a16._w4a16_gemv_tuned
        assert w4a16._tuned_gemv(torch.bfloat16, dict(consts, HAS_ZERO=True)) is w4a16._w4a16_gemv_tuned
        assert w4a16._tuned_gemv(torch.bfloat16, dict(consts, V=1)) is w4a16._w4a16_gemv_tuned

    def test_every_tile_takes_whole_gemv_steps_of_whole_chunks(self):
        """`w4a16.gemv_split_step` runs K in MAX_BLOCK_K steps (unmasked when K is a multiple): every
        tile's BLOCK_K must divide it; a thread's 4-word loads are chunks."""
        for config in f16x2.GEMV_CONFIGS:
            assert w4a16.MAX_BLOCK_K % (8 * config.kwargs["BLOCK_KW"]) == 0 and config.kwargs["BLOCK_KW"] % 4 == 0


# ---------------------------------------------------------------------------------------------
# offline sm_90 compiles

_SIG = {"x_ptr": "*{t}", "qw_ptr": "*i32", "s_ptr": "*{t}", "z_ptr": "*u8", "b_ptr": "*{t}", "y_ptr": "*{t}",
        "k_split": "i32", **{s: "i32" for s in ("stride_xm", "stride_qn", "stride_sn", "stride_zn", "stride_ym",
                                                 "stride_ys", "N", "K")}}


def _compile_sm90(dtype: str, config, **consts):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = f16x2._w4a16_gemv_f16x2_kernel
    sig = {a: t.format(t=dtype) for a, t in _SIG.items()}
    if consts.get("PARTIAL"):
        sig["y_ptr"] = "*fp32"
    aligned = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items()
               if t.startswith("*") or a.startswith("stride") or a in ("N", "K")}  # as Triton specializes 4096
    consts = dict(dict(M=1, GROUP=128, V=4, HAS_ZERO=False, HAS_BIAS=False, PARTIAL=False, MASK_K=False), **consts,
                  **config.kwargs)
    src = ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in consts}}, constexprs=consts, attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": config.num_warps})


def _needs_cuobjdump():
    from tests.kernels.sm90_compile import cuobjdump_path

    if INTERPRET:
        pytest.skip("the interpreter replaces the compiled kernels")
    if cuobjdump_path() is None:
        pytest.skip("Triton ships no cuobjdump here")


# Loop SASS instructions per weight it loads, by (M, words a thread): the float32 GEMV's are
# 5.8 / 5.1 at M = 1 and 11.9 / 9.9 at M = 4 (8 / 16 words); measured here 3.05 / 2.43 and
# 7.6 / 5.7 (bf16), 2.5 / 2.2 and 5.7 / 4.6 (fp16).
INSTRUCTIONS_A_WEIGHT = {(1, 8): 3.3, (1, 16): 2.6, (4, 8): 8.0, (4, 16): 6.0}


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_every_tile_compiles_for_hopper_in_few_instructions_a_weight(m, dtype):
    """No spills (cuobjdump STACK 0), no layout conversion in the K loop, 16-byte word loads, and
    the half2 arithmetic in the loop (HFMA2): the K loop's SASS per weight under the bound."""
    from tests.kernels.sm90_compile import loop_sass, stack_bytes

    _needs_cuobjdump()
    for config in f16x2.GEMV_CONFIGS:
        kernel = _compile_sm90(dtype, config, M=m)
        ttgir = kernel.asm["ttgir"]
        loop_ir = ttgir[ttgir.index("scf.for"):ttgir.index("scf.yield")]
        assert "convert_layout" not in loop_ir and "local_" not in loop_ir, f"{config}: layout conversion in the K loop"
        assert stack_bytes(kernel) == 0, f"{config} spills registers"
        loop = loop_sass(kernel)
        weights = 32 * sum(op.startswith("LDG.E.128") for op in loop)  # 4 words, 32 weights a load
        assert weights and any(op.startswith("HFMA2") for op in loop), f"{config}: not the half2 loop"
        words = config.kwargs["BLOCK_N"] * config.kwargs["BLOCK_KW"] // (32 * config.num_warps)
        assert len(loop) / weights < INSTRUCTIONS_A_WEIGHT[m, words], f"{config}: {len(loop) / weights:.2f} a weight"


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_masked_split_and_bias_variants_compile_for_hopper(dtype):
    from tests.kernels.sm90_compile import stack_bytes

    _needs_cuobjdump()
    config = f16x2.GEMV_CONFIGS[1]
    for consts in (dict(M=2, MASK_K=True, PARTIAL=True, GROUP=32), dict(M=3, HAS_BIAS=True, GROUP=16384)):
        assert stack_bytes(_compile_sm90(dtype, config, **consts)) == 0, consts


# ---------------------------------------------------------------------------------------------
# GPU: the kernel through w4a16_gemm's dispatch (random words are random nibbles, read in the kernel
# layout; the reference deinterleaves them)

LLAMA_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down
ODD_SHAPES = [(72, 11008), (1000, 1376)]  # N off every tile; K off the 1,024-column step (masked)


def _pin(monkeypatch, config) -> None:
    """The f16x2 autotuner given one tile (it then runs it without timing)."""
    monkeypatch.setattr(f16x2._w4a16_gemv_f16x2_tuned, "configs", [config])


def _check(n, k, m, group, dtype, bias=False, gemv_split=1, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    qweight = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda", generator=g)
    scales = (torch.rand(n, k // group, device="cuda", generator=g) * 0.02 + 0.005).to(dtype)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    b = torch.randn(n, device="cuda", generator=g).to(dtype) if bias else None
    out = w4a16.w4a16_gemm(x, qweight, scales, None, group, b, gemv_split=gemv_split, interleave=INT4_INTERLEAVE)
    ref = w4a16_gemm_ref(x, qweight, scales, None, group, b, interleave=INT4_INTERLEAVE)
    assert rel_err(out, ref) < GPU_TOL[dtype], (n, k, m, group, dtype, rel_err(out, ref))


@pytest.mark.gpu
class TestOnGpu:
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("m", [1, 2, 3, 4])
    @pytest.mark.parametrize("n, k", LLAMA_SHAPES)
    def test_matches_reference_on_llama_shapes(self, n, k, m, dtype):
        """Autotuned, group 128 (the int4 checkpoints'), a bias at even M."""
        _check(n, k, m, 128, dtype, bias=m % 2 == 0, seed=m)
        tuned = f16x2._w4a16_gemv_f16x2_tuned.cache  # keyed by M, N, K, GROUP, ...: the f16x2 kernel ran
        assert any(key[:4] == (m, n, k, 128) for key in tuned), list(tuned)

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("group", [32, 64, 128, None])  # None: per channel
    @pytest.mark.parametrize("n, k", [(4096, 4096), *ODD_SHAPES])
    def test_group_sizes_and_odd_shapes(self, monkeypatch, n, k, group, dtype):
        group = group or k
        if k % group:
            pytest.skip(f"group {group} does not divide K={k}")
        _pin(monkeypatch, f16x2.GEMV_CONFIGS[1])
        for m in (1, 3):
            _check(n, k, m, group, dtype, bias=True, seed=group)

    @pytest.mark.parametrize("config", f16x2.GEMV_CONFIGS, ids=str)
    def test_every_tile(self, monkeypatch, config):
        _pin(monkeypatch, config)
        for (n, k), m in itertools.product([(4096, 4096), ODD_SHAPES[0]], (1, 4)):
            _check(n, k, m, 128, torch.bfloat16, bias=m == 4)

    @pytest.mark.parametrize("gemv_split", [2, 3])
    @pytest.mark.parametrize("n, k", [(4096, 14336), ODD_SHAPES[0]])
    def test_split_k(self, n, k, gemv_split):
        for m in (1, 4):
            _check(n, k, m, 128, torch.bfloat16, bias=True, gemv_split=gemv_split)

    def test_cuda_graph_replays_after_the_warm_up(self):
        n, k, group = 4096, 4096, 128
        qweight = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda")
        scales = (torch.rand(n, k // group, device="cuda") * 0.02).to(torch.bfloat16)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        run = lambda: w4a16.w4a16_gemm(x, qweight, scales, None, group, interleave=INT4_INTERLEAVE)  # noqa: E731
        run()  # warm-up: compiles and autotunes outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = run()
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert torch.equal(y, run())


@pytest.mark.gpu
def test_custom_op_takes_the_f16x2_gemv():
    if INTERPRET or not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from atom_core.quant.int_ops import w4a16_gemm

    q = torch.randint(-2**31, 2**31 - 1, (4096, 512), dtype=torch.int32, device="cuda")
    s = (torch.rand(4096, 32, device="cuda") * 0.02).to(torch.bfloat16)
    x = torch.randn(2, 4096, device="cuda", dtype=torch.bfloat16)
    before = len(f16x2._w4a16_gemv_f16x2_tuned.cache)
    y, ref = w4a16_gemm(x, q, s, None, 128, None, 4), w4a16_gemm_ref(x, q, s, None, 128, None, 4)
    assert len(f16x2._w4a16_gemv_f16x2_tuned.cache) >= max(before, 1) and rel_err(y, ref) < GPU_TOL[torch.bfloat16]
