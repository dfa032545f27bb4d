"""The weight-only FP8 GEMM for 2-64 tokens (`kernels/triton/fp8_w8a16.py`) and its dispatch.

- the kernel equals `fp8_gemv_ref` (W dequantized to float32, x not quantized, a float32 matmul) on
  fresh random inputs: `cpu` cases under Triton's interpreter (M 2-64, N and K multiples and
  non-multiples of the tiles, per-tensor and per-channel scales, split-K by the grid and forced,
  bias, x in float32/bf16); `cuda` cases (marker `gpu`) at Llama-3-8B shapes;
- bad input fails clearly (which M the linears give it: test_fp8_gemm.py's tables);
- an offline sm_90 compile of the default tiles without spills.

Tolerances: float32 sums of the same products in another order (1e-5 relative) for float32 x; bf16
results rounded once from float32 sums (TOL).
"""
from __future__ import annotations

import pytest
import torch

from atom_core.kernels.triton.fp8_gemv import fp8_gemv_ref
from atom_core.quant.fp8_ops import FP8_DTYPE
from tests.kernels.conftest import device  # noqa: F401  (the cpu-interpreter / cuda fixture)
from tests.kernels.tolerances import INTERPRET, TOL, rel_err
from tests.quant.test_fp8_gemm import channel_weight, seeded

F32_TOL = 1e-5


def _run(x, w, s, bias=None, split_k=None):
    from atom_core.kernels.triton.fp8_w8a16 import fp8_w8a16_gemm

    return fp8_w8a16_gemm(x, w, s, bias, split_k=split_k)


@pytest.mark.parametrize("m, n, k", [(2, 96, 200), (5, 64, 128), (16, 130, 256), (33, 72, 136), (64, 40, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_matches_weight_only_reference(device, m, n, k, dtype, per_tensor):
    gen = seeded("w8a16", m, n, k, dtype, per_tensor)
    w, s = channel_weight(gen, n, k)
    if per_tensor:
        s = s.max().reshape(1)
        w = (w.float() * 0.5).to(FP8_DTYPE)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if m % 2 else None
    ref = fp8_gemv_ref(x, w, s, None, bias)
    out = _run(x.to(device), w.to(device), s.to(device), None if bias is None else bias.to(device))
    assert rel_err(out.cpu(), ref) < (F32_TOL if dtype == torch.float32 else TOL[dtype])


@pytest.mark.parametrize("split_k", [1, 3, 50])
def test_forced_splits_equal_the_reference(device, split_k):
    """Float32 partials summed in split order with the bias; splits beyond K's steps run as many as there are."""
    gen = seeded("w8a16-split", split_k)
    w, s = channel_weight(gen, 48, 320)
    x, bias = torch.randn(3, 320, generator=gen), torch.randn(48, generator=gen)
    out = _run(x.to(device), w.to(device), s.to(device), bias.to(device), split_k=split_k)
    assert rel_err(out.cpu(), fp8_gemv_ref(x, w, s, None, bias)) < F32_TOL


def test_tiles_override_keeps_the_result(device):
    """The benchmark's sweep passes tiles (BLOCK_N, BLOCK_K, warps, stages); the split follows the grid."""
    from atom_core.kernels.triton.fp8_w8a16 import fp8_w8a16_gemm

    gen = seeded("w8a16-tiles")
    w, s = channel_weight(gen, 80, 192)
    x = torch.randn(4, 192, generator=gen)
    out = fp8_w8a16_gemm(x.to(device), w.to(device), s.to(device), tiles=(32, 64, 4, 3))
    assert rel_err(out.cpu(), fp8_gemv_ref(x, w, s)) < F32_TOL


def test_bad_input_fails_clearly():
    w, s = channel_weight(seeded("bad"), 16, 32)
    with pytest.raises(ValueError, match="at most 64 rows of x, got 65"):
        _run(torch.randn(65, 32), w, s)
    with pytest.raises(ValueError, match="split_k must be >= 1, got 0"):
        _run(torch.randn(2, 32), w, s, split_k=0)
    with pytest.raises(ValueError, match="weight_scale must hold 1 or N=16 values"):
        _run(torch.randn(2, 32), w, torch.ones(3))
    with pytest.raises(ValueError, match="x has 31 columns"):
        _run(torch.randn(2, 31), w, s)


@pytest.mark.skipif(INTERPRET, reason="the interpreter replaces the compiled kernels")
@pytest.mark.parametrize("m", [2, 32, 64])
def test_default_tiles_compile_for_hopper_without_spills(m):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from atom_core.kernels.triton import fp8_w8a16 as k8
    from tests.kernels.sm90_compile import cuobjdump_path, stack_bytes

    if cuobjdump_path() is None:
        pytest.skip("Triton ships no cuobjdump here")
    bm, bn, bk, split, warps, stages = k8.default_tiles(m, 4096, 14336, 132, 2)
    assert (bn, bk) == ((32, 256) if m <= 16 else (64, 128))
    fn = k8._w8a16_kernel
    sig = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "b_ptr": "*fp32", "out_ptr": "*fp32",
           **{a: "i32" for a in ("M", "N", "K", "steps_per_split", "stride_xm", "stride_wn", "stride_ws",
                                 "stride_om", "stride_os")}}
    aligned = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items()
               if t.startswith("*") or a.startswith("stride") or a in ("N", "K")}
    consts = dict(HAS_BIAS=False, IS_SPLIT=True, MASK_K=False, IEEE=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    src = ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in consts}}, constexprs=consts, attrs=aligned)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    assert split == (3 if m <= 16 else 5)  # N = 4096: 128 / 64 column tiles, split to >= 2 programs an SM
    assert stack_bytes(kernel) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 8, 32, 64])
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_llama_shapes_on_cuda(m, n, k):
    if INTERPRET or not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator(device="cuda").manual_seed(m * 7 + n)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 32).to(FP8_DTYPE)
    s = torch.rand(n, 1, device="cuda", generator=gen) / (32 * k ** 0.5) + 1e-5
    x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    assert rel_err(_run(x, w, s), fp8_gemv_ref(x, w, s)) < 4e-3
