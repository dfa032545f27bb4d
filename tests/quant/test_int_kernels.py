"""INT4/INT8 products: int4 packing, the torch references against a dequantize-then-matmul
oracle built from unpacked integers (never through our packing), and the Triton kernels
against the references (on the CPU under TRITON_INTERPRET=1, on a GPU with the `gpu` marker).
"""
import pytest
import torch

from atom_core.quant.int_ops import (
    dequantize_int4, int8_w8a8_gemm_ref, pack_int4, quantize_per_token_int8, unpack_int4, w4a16_gemm_ref,
)
from tests.kernels.tolerances import INTERPRET, TOL, rel_err


@pytest.fixture(params=[
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(INTERPRET, reason="interpreter mode")]),
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1 to run on CPU")),
])
def device(request) -> str:
    return request.param


def _int4_case(n, k, group, asym, dtype, seed=0):
    """Unpacked integers u [N, K], zeros [N, G], scales [N, G] and the canonical packed tensors."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    zeros = torch.randint(0, 16, (n, k // group), generator=g, dtype=torch.uint8) if asym else None
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 0.005).to(dtype)
    return u, zeros, scales, pack_int4(u, 1)


def _oracle_w4(x, u, zeros, scales, group):
    z = torch.full_like(scales, 8, dtype=torch.float64) if zeros is None else zeros.double()
    w = (u.double() - z.repeat_interleave(group, 1)) * scales.double().repeat_interleave(group, 1)
    return x.double() @ w.t()


class TestPacking:
    def test_interleave_puts_column_j_times_4_plus_i_in_nibble_j_of_word_i(self):
        """The kernel layout, checked against its definition on unpacked integers (not through the
        inverse): chunk c's word i, nibble j holds column 32c + 4j + i; the inverse restores the words."""
        from atom_core.quant.int_ops import deinterleave_int4, interleave_int4

        u = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
        inter = interleave_int4(pack_int4(u, 1))
        words = inter.view(3, 2, 4)  # [N, chunk, word i]
        for c in range(2):
            for i in range(4):
                for j in range(8):
                    assert torch.equal((words[:, c, i] >> (4 * j)) & 0xF, u[:, 32 * c + 4 * j + i].int())
        assert torch.equal(deinterleave_int4(inter, 4), pack_int4(u, 1))
        x = torch.randn(2, 64, dtype=torch.float64)
        scales = torch.rand(3, 2, dtype=torch.float64)
        assert torch.allclose(w4a16_gemm_ref(x, inter, scales, None, 32, interleave=4),
                              _oracle_w4(x, u, None, scales, 32))

    def test_pack_unpack_round_trip_with_padding(self):
        v = torch.randint(0, 16, (5, 21), dtype=torch.uint8)
        packed = pack_int4(v, 1)
        assert packed.shape == (5, 3) and packed.dtype == torch.int32
        assert torch.equal(unpack_int4(packed, 1, 21), v)
        assert torch.equal(unpack_int4(pack_int4(v, 0), 0, 5), v)

    def test_nibble_order(self):
        v = torch.arange(8, dtype=torch.uint8)[None]
        assert pack_int4(v, 1).item() == 0x76543210
        awq = torch.tensor([[0x75316420]], dtype=torch.int32)  # AWQ: nibble i holds value [0,2,4,6,1,3,5,7][i]
        assert unpack_int4(awq, 1, order=[0, 2, 4, 6, 1, 3, 5, 7]).tolist() == [list(range(8))]

    def test_sign_bit_words(self):
        v = torch.full((1, 8), 15, dtype=torch.uint8)
        assert pack_int4(v, 1).item() == -1 and unpack_int4(torch.tensor([[-1]], dtype=torch.int32), 1).eq(15).all()


class TestReferences:
    @pytest.mark.parametrize("m, n, k, group, asym", [
        (1, 24, 64, 32, False), (5, 200, 192, 64, True), (33, 136, 320, 32, True), (3, 72, 256, 128, False),
        (7, 40, 96, 96, True),  # per channel: one group of K
    ])
    def test_w4a16_ref_matches_oracle(self, m, n, k, group, asym):
        u, zeros, scales, qweight = _int4_case(n, k, group, asym, torch.float32)
        x = torch.randn(m, k)
        assert torch.allclose(dequantize_int4(qweight, scales, zeros, group).double(),
                              _oracle_w4(torch.eye(k), u, zeros, scales, group).t(), atol=1e-6)
        bias = torch.randn(n)
        out = w4a16_gemm_ref(x, qweight, scales, zeros, group, bias)
        assert rel_err(out, _oracle_w4(x, u, zeros, scales, group) + bias.double()) < 1e-5

    @pytest.mark.parametrize("m, n, k", [(1, 24, 64), (9, 130, 200), (40, 72, 333)])
    def test_int8_ref_matches_oracle(self, m, n, k):
        g = torch.Generator().manual_seed(m)
        x = torch.randn(m, k, generator=g) * 3
        x[0, :3] = 0.0
        weight = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        w_scale = torch.rand(n, 1, generator=g) * 0.01
        # oracle: compressed-tensors' fake quantization (x / scale in float32, as it computes it: the
        # row's absmax lands on +-127.5 exactly, a tie), then dequantized values multiplied in float64
        s = x.abs().amax(-1, keepdim=True) / 127.5
        xq = torch.clamp(torch.round(x / s), -128, 127).double()
        expected = (xq * s.double()) @ (weight.double() * w_scale.double()).t()
        assert rel_err(int8_w8a8_gemm_ref(x, weight, w_scale), expected) < 1e-5

    def test_per_token_quant_rounds_half_to_even_and_keeps_zero_rows(self):
        x = torch.tensor([[127.5, 0.5 * 127.5 / 127.5 * 1.0, -127.5, 1.5], [0.0, 0.0, 0.0, 0.0]])
        q, s = quantize_per_token_int8(x)
        assert s[0].item() == 1.0 and q[0].tolist() == [127, 0, -128, 2]
        assert q[1].eq(0).all() and s[1].item() == 1.0


class TestTritonKernels:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("m, n, k, group, asym", [
        (1, 40, 128, 32, True), (3, 24, 192, 64, False), (20, 40, 128, 128, True), (17, 24, 64, 32, False),
        (2, 16, 96, 96, True), (18, 16, 96, 96, False),  # per channel, K not a power of two
        (1, 16, 512, 128, False),  # several groups per GEMV step on the GPU
        (6, 24, 128, 64, True), (8, 16, 64, 32, False),  # GEMV rows in two launches (4 + 2, 4 + 4)
        (4, 16, 72, 72, True),  # K not a multiple of 32: canonical layout only
    ])
    @pytest.mark.parametrize("interleave", [1, 4])
    def test_w4a16_matches_reference(self, device, dtype, m, n, k, group, asym, interleave):
        """Both layouts (canonical, and the kernel layout the int4 linears store) on the GEMV (M <= 8)
        and the GEMM, symmetric and asymmetric, against the reference on the canonical weights."""
        from atom_core.kernels.triton.w4a16 import w4a16_gemm
        from atom_core.quant.int_ops import interleave_int4

        if k % (8 * interleave):
            pytest.skip("the kernel layout needs K a multiple of 32")
        u, zeros, scales, qweight = _int4_case(n, k, group, asym, dtype, seed=m)
        x = torch.randn(m, k).to(dtype)
        bias = torch.randn(n).to(dtype) if asym else None
        ref = w4a16_gemm_ref(x, qweight, scales, zeros, group, bias)
        to = lambda t: None if t is None else t.to(device)  # noqa: E731
        out = w4a16_gemm(to(x), to(interleave_int4(qweight, interleave)), to(scales), to(zeros), group, to(bias),
                         interleave=interleave)
        assert rel_err(out.cpu(), ref) < TOL[dtype]

    @pytest.mark.parametrize("gemv_split", [2, 3, 8])
    @pytest.mark.parametrize("m, n, k, group, asym", [
        (1, 40, 512, 128, True), (3, 24, 192, 64, False), (2, 16, 1088, 64, True),  # K = 17 interpreter steps
        (1, 16, 96, 96, True),  # per channel: one scale for the whole row, split or not
    ])
    def test_w4a16_gemv_split_k_matches_reference(self, device, m, n, k, group, asym, gemv_split):
        """The GEMV over K splits (float32 partials, then the split sum adds the bias) equals the
        reference; splits beyond the K steps run as many as there are."""
        from atom_core.kernels.triton.w4a16 import w4a16_gemm
        from atom_core.quant.int_ops import interleave_int4

        u, zeros, scales, qweight = _int4_case(n, k, group, asym, torch.float32, seed=gemv_split)
        x = torch.randn(m, k)
        bias = torch.randn(n) if asym else None
        ref = w4a16_gemm_ref(x, qweight, scales, zeros, group, bias)
        to = lambda t: None if t is None else t.to(device)  # noqa: E731
        out = w4a16_gemm(to(x), to(interleave_int4(qweight)), to(scales), to(zeros), group, to(bias),
                         gemv_split=gemv_split, interleave=4)
        assert rel_err(out.cpu(), ref) < TOL[torch.float32]

    def test_w4a16_rejects_a_bad_interleave(self, device):
        from atom_core.kernels.triton.w4a16 import w4a16_gemm

        u, zeros, scales, qweight = _int4_case(16, 72, 72, False, torch.float32)
        x = torch.randn(1, 72, device=device)
        with pytest.raises(ValueError, match="interleave 4 with K=72"):
            w4a16_gemm(x, qweight.to(device), scales.to(device), None, 72, interleave=4)
        with pytest.raises(ValueError, match="interleave 2"):
            w4a16_gemm(x, qweight.to(device), scales.to(device), None, 72, interleave=2)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("m, n, k", [(1, 24, 64), (5, 40, 100), (20, 16, 48)])
    def test_int8_matches_reference(self, device, dtype, m, n, k):
        from atom_core.kernels.triton.int8 import int8_w8a8_gemm, quantize_per_token_int8 as quant_kernel

        g = torch.Generator().manual_seed(k)
        x = (torch.randn(m, k, generator=g) * 2).to(dtype)
        weight = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        w_scale = torch.rand(n, 1, generator=g) * 0.01
        q, s = quant_kernel(x.to(device))
        q_ref, s_ref = quantize_per_token_int8(x)
        assert torch.equal(q.cpu(), q_ref) and torch.equal(s.cpu(), s_ref)
        out = int8_w8a8_gemm(x.to(device), weight.to(device), w_scale.to(device))
        assert rel_err(out.cpu(), int8_w8a8_gemm_ref(x, weight, w_scale)) < TOL[dtype]

    def test_w4a16_rejects_bad_group(self, device):
        from atom_core.kernels.triton.w4a16 import w4a16_gemm

        _, _, scales, qweight = _int4_case(8, 64, 32, False, torch.float32)
        with pytest.raises(ValueError, match="group size"):
            w4a16_gemm(torch.randn(1, 64, device=device), qweight.to(device), scales.to(device), None, 16)


@pytest.mark.skipif(INTERPRET, reason="the interpreter replaces the compiled kernels")
def test_kernels_compile_for_hopper():
    """Compile every kernel for sm_90 without a GPU (Triton ships the NVIDIA toolchain), so a
    construct the interpreter accepts but the compiler rejects (an int8 dot without an int32
    out_dtype did) fails on the CPU; the quantization must use IEEE division (div.rn)."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from atom_core.kernels.triton import int8 as k8, w4a16 as k4

    def ptx(fn, sig, consts, **options):
        src = ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in consts}}, constexprs=consts)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]

    quant = ptx(k8._quant_per_token_kernel, {"x_ptr": "*bf16", "q_ptr": "*i8", "s_ptr": "*fp32", "K": "i32",
                                             "stride_xm": "i32", "stride_qm": "i32"}, {"BLOCK_K": 4096}, num_warps=8)
    assert set(re.findall(r"div\.[a-z.0-9]+", quant)) == {"div.rn.f32"}
    ptx(k8._int8_mm_kernel, {"a_ptr": "*i8", "b_ptr": "*i8", "sa_ptr": "*fp32", "sb_ptr": "*fp32", "bias_ptr": "*fp32",
                             "y_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_am": "i32",
                             "stride_bn": "i32", "stride_ym": "i32"},
        {"HAS_BIAS": True, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256}, num_warps=4, num_stages=4)
    w4 = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*u8", "b_ptr": "*bf16", "y_ptr": "*bf16",
          "N": "i32", "K": "i32", "stride_xm": "i32", "stride_qn": "i32", "stride_sn": "i32", "stride_zn": "i32",
          "stride_ym": "i32"}
    for partial in (False, True):  # split-K writes float32 partials (the kernel layout's tiles: the test below)
        gemv = {**w4, "y_ptr": "*fp32" if partial else "*bf16", "k_split": "i32", "stride_ys": "i32"}
        ptx(k4._w4a16_gemv_kernel, gemv, {"M": 2, "GROUP": 256, "V": 1, "HAS_ZERO": True, "HAS_BIAS": True,
                                          "PARTIAL": partial, "MASK_K": True, "BLOCK_N": 8, "BLOCK_KW": 16})
    ptx(k4._w4a16_mm_kernel, {**w4, "M": "i32"},
        {"GROUP": 128, "V": 4, "HAS_ZERO": False, "HAS_BIAS": True, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64,
         "DOT_PRECISION": None, "DOT_IN_FP32": False}, num_warps=4, num_stages=3)


class TestGemvSplitRule:
    def test_splits_keep_bytes_in_flight_and_runs_whole(self):
        from atom_core.kernels.triton.w4a16 import gemv_split_k

        assert gemv_split_k(4096, 4096, 512, 132) == 2  # 1 MB a step, under the 1.6 MB 132 SMs want
        assert gemv_split_k(4096, 14336, 512, 132) == 2
        assert gemv_split_k(28672, 4096, 512, 132) == 1  # gate_up: enough rows
        assert gemv_split_k(512, 8192, 512, 132) == 8  # narrow: capped
        assert gemv_split_k(512, 1024, 512, 132) == 2  # no more splits than K steps

    def test_a_split_below_one_is_a_clear_error(self):
        from atom_core.kernels.triton.w4a16 import w4a16_gemm

        u, zeros, scales, qweight = _int4_case(16, 64, 32, False, torch.float32)
        with pytest.raises(ValueError, match="gemv_split must be >= 1"):
            w4a16_gemm(torch.randn(1, 64), qweight, scales, None, 32, gemv_split=0)


@pytest.mark.skipif(INTERPRET, reason="the interpreter replaces the compiled kernels")
@pytest.mark.parametrize("m, has_zero", [(1, False), (1, True), (4, False)])
def test_w4a16_gemv_compiles_for_hopper_without_spills_or_layout_conversions(m, has_zero):
    """Every autotuner tile of the GEMV compiles for sm_90 with Triton's bundled toolchain (no GPU) on
    the kernel layout at Llama-3-8B's o_proj shape: words load 16 bytes and x 8 bytes a thread, no
    layout conversion in the K loop (a shared-memory round trip and a barrier a step: what the
    canonical layout costs) and no spills (cuobjdump STACK 0)."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from atom_core.kernels.triton import w4a16
    from tests.kernels.sm90_compile import cuobjdump_path, stack_bytes

    if cuobjdump_path() is None:
        pytest.skip("Triton ships no cuobjdump here")
    fn = w4a16._w4a16_gemv_kernel
    sig = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*u8", "b_ptr": "*bf16", "y_ptr": "*bf16",
           "k_split": "i32", **{s: "i32" for s in ("stride_xm", "stride_qn", "stride_sn", "stride_zn", "stride_ym",
                                                    "stride_ys", "N", "K")}}
    aligned = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items()
               if t.startswith("*") or a.startswith("stride") or a in ("N", "K")}  # as Triton specializes 4096
    for config in w4a16._GEMV_CONFIGS:
        consts = dict(M=m, GROUP=128, V=4, HAS_ZERO=has_zero, HAS_BIAS=False, PARTIAL=False, MASK_K=False,
                      **config.kwargs)
        src = ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in consts}}, constexprs=consts, attrs=aligned)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": config.num_warps})
        ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
        assert re.search(r"ld\.global[.\w]*\.v4\.b32", ptx), f"{config}: words should load 16 bytes a thread"
        assert re.search(r"ld\.global[.\w]*\.v2\.b32", ptx), f"{config}: x should load 4 values a thread"
        loop = ttgir[ttgir.index("scf.for"):ttgir.index("scf.yield")]
        assert "convert_layout" not in loop and "local_" not in loop, f"{config}: layout conversion in the K loop"
        assert stack_bytes(kernel) == 0, f"{config} spills registers"
