"""The gated-DeltaNet Triton kernels against their torch references (kernels/gdn_ref.py, itself checked
against HF in test_gdn.py) on fresh random packed inputs: small shapes on both devices (the CPU runs
Triton's interpreter), Qwen3-Next's shapes on CUDA only, each in a fresh process (a kernel fault kills
its CUDA context, and every later case in that process would fail with it). The chunked prefill is also
checked stage by stage (each of its three kernels' buffers against a torch computation of the same
quantity), so a failure names its kernel. An offline sm_90 compile test (no GPU; run with
TRITON_INTERPRET=0) checks the chunk kernels' dot layouts and register spills at Qwen3-Next's shapes."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from atom_core.kernels import torch_ref
from atom_core.kernels import triton as triton_ops
from atom_core.kernels.gdn_ref import CHUNK_SIZE, l2norm
from atom_core.kernels.triton import gated_delta
from tests.kernels.test_gdn import conv_inputs, cu_seqlens_of, gdn_inputs, rel_err, run_rule
from tests.kernels.tolerances import INTERPRET

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
RULES = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]
# Qwen3-Next-80B-A3B: 16 q/k heads, 32 v heads, head dims 128, conv width 4 over q, k and v channels.
QWEN3_NEXT = dict(num_k_heads=16, num_v_heads=32, k_dim=128, v_dim=128, conv_width=4)
QWEN3_NEXT_HEADS = (QWEN3_NEXT["num_k_heads"], QWEN3_NEXT["num_v_heads"])
QWEN3_NEXT_DIMS = (QWEN3_NEXT["k_dim"], QWEN3_NEXT["v_dim"])
QWEN3_NEXT_CONV_CHANNELS = (2 * QWEN3_NEXT["num_k_heads"] * QWEN3_NEXT["k_dim"]
                            + QWEN3_NEXT["num_v_heads"] * QWEN3_NEXT["v_dim"])  # q, k and v
REPO = Path(__file__).resolve().parents[2]


def in_fresh_process(case: str, *args) -> None:
    """Runs this module's `case(*args)` in a new interpreter and fails with its output if it fails."""
    code = f"import sys, torch; from tests.kernels.test_gdn_triton import {case}; {case}(*{args!r}); sys.exit(0)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          check=False, timeout=600)
    assert done.returncode == 0, f"{case}{args} failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"


def assert_close(what: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    err = rel_err(got.cpu(), want)
    assert err < tol, f"{what}: relative error {err:.3g} (bound {tol:.3g})"


def check_rule(name, lens, heads, dims, dtype, device, has_init=None, seed=0):
    """Runs the kernel and the reference on the same inputs; compares outputs and the whole pool."""
    x = gdn_inputs(lens, *heads, *dims, dtype=dtype, has_init=has_init, seed=seed, device=device)
    ref = gdn_inputs(lens, *heads, *dims, dtype=dtype, has_init=has_init, seed=seed)
    out = run_rule(getattr(triton_ops, name, None) or getattr(gated_delta, name), x)
    if device == "cuda":
        torch.cuda.synchronize()  # a kernel fault surfaces here, under this op's name
    want = run_rule(torch_ref.fused_recurrent_gated_delta_rule, ref)
    assert out.dtype == dtype and out.shape == want.shape
    assert_close("out", out, want, TOL[dtype])
    assert_close("state pool", x.state, ref.state, TOL[dtype])
    untouched = torch.ones(ref.state.shape[0], dtype=torch.bool)
    untouched[ref.state_indices.long()] = False
    assert torch.equal(x.state.cpu()[untouched], ref.state[untouched])


def chunk_stage_reference(x) -> tuple[torch.Tensor, ...]:
    """fp32 torch, in gdn_ref._chunk_step's algebra: W, U and v_new per token row, and the state each
    chunk starts from, chunks numbered sequence by sequence (as kernels.triton.gated_delta.chunk_layout)."""
    num_tokens, num_k_heads, k_dim = x.q.shape
    num_v_heads, v_dim = x.v.shape[1:]
    group = num_v_heads // num_k_heads
    w, u, v_new = (torch.zeros(num_tokens, num_v_heads, d) for d in (k_dim, v_dim, v_dim))
    chunk_states = []
    bounds, slots, has_init = x.cu_seqlens.tolist(), x.state_indices.tolist(), x.has_initial_state.tolist()
    for i, slot in enumerate(slots):
        start, end = bounds[i], bounds[i + 1]
        s = x.state[slot].clone() if has_init[i] and slot >= 0 else torch.zeros(num_v_heads, k_dim, v_dim)
        ks = l2norm(x.k[start:end].float()).repeat_interleave(group, 1).transpose(0, 1)  # [Hv, L, Dk]
        vs, gs, bs = x.v[start:end].float().transpose(0, 1), x.g[start:end].t(), x.beta[start:end].float().t()
        for c in range(0, end - start, CHUNK_SIZE):
            span = slice(c, min(c + CHUNK_SIZE, end - start))
            rows = slice(start + span.start, start + span.stop)
            kc, vc, bc, cum = ks[:, span], vs[:, span], bs[:, span], gs[:, span].cumsum(-1)
            upper = torch.ones(kc.shape[1], kc.shape[1], dtype=torch.bool).triu(1)
            decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(upper, float("-inf")).exp()
            a = (bc[:, :, None] * (kc @ kc.transpose(1, 2)) * decay).tril(-1)
            wc, uc = (torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
                      for rhs in (kc * (bc * cum.exp())[..., None], vc * bc[..., None]))
            chunk_states.append(s)
            vn = uc - wc @ s
            w[rows], u[rows], v_new[rows] = wc.transpose(0, 1), uc.transpose(0, 1), vn.transpose(0, 1)
            s = s * cum[:, -1].exp()[:, None, None] + (kc * (cum[:, -1:] - cum).exp()[..., None]).transpose(1, 2) @ vn
    return w, u, torch.stack(chunk_states), v_new


def check_prep(lens, heads, dims, dtype, device, key_bias=0.0):
    """The prep kernel's W and U against chunk_stage_reference's (a triangular solve per chunk). key_bias
    adds one shared direction to every key: A's entries then near beta, not ~1/sqrt(Dk), so T's entries
    far from the diagonal are large and the whole substitution is tested in earnest."""
    x, ref = (gdn_inputs(lens, *heads, *dims, dtype=dtype, device=dev) for dev in (device, "cpu"))
    shared = torch.randn(1, 1, dims[0], generator=torch.Generator().manual_seed(1))
    x, ref = (t._replace(k=(t.k.float() + key_bias * shared.to(t.k.device)).to(dtype)) for t in (x, ref))
    stages = run_rule(gated_delta.chunk_stages, x)
    w, u, _, _ = chunk_stage_reference(ref)
    assert_close("prep kernel: W", stages.w, w, TOL[dtype])
    assert_close("prep kernel: U", stages.u, u, TOL[dtype])


def check_stages(lens, heads, dims, dtype, device, has_init=None):
    """Each chunk kernel's buffers against chunk_stage_reference, in kernel order, then o and the pool."""
    x = gdn_inputs(lens, *heads, *dims, dtype=dtype, has_init=has_init, device=device)
    ref = gdn_inputs(lens, *heads, *dims, dtype=dtype, has_init=has_init)
    stages = run_rule(gated_delta.chunk_stages, x)
    if device == "cuda":
        torch.cuda.synchronize()
    w, u, chunk_states, v_new = chunk_stage_reference(ref)
    tol = TOL[dtype]
    assert_close("prep kernel: W", stages.w, w, tol)
    assert_close("prep kernel: U", stages.u, u, tol)
    assert_close("state kernel: chunk start states", stages.chunk_states[:len(chunk_states)], chunk_states, tol)
    assert_close("state kernel: v_new", stages.v_new, v_new, tol)
    assert_close("output kernel: o", stages.out, run_rule(torch_ref.fused_recurrent_gated_delta_rule, ref), tol)
    assert_close("state kernel: final states", x.state, ref.state, tol)


class TestChunkGatedDeltaRule:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("lens,heads,dims,has_init", [
        ([5, CHUNK_SIZE], (1, 2), (16, 16), [False, True]),  # below and at the chunk size, Hv = 2 Hk
        ([CHUNK_SIZE + 6, 3], (1, 1), (16, 32), [True, False]),  # above it, Hv = Hk
        ([CHUNK_SIZE + 3], (1, 2), (16, 64), [True]),  # the scan over two v blocks
    ], ids=["short_and_one_chunk", "two_chunks", "two_v_blocks"])
    def test_matches_reference(self, device, dtype, lens, heads, dims, has_init):
        check_rule("chunk_gated_delta_rule", lens, heads, dims, dtype, device, has_init)

    @pytest.mark.parametrize("lens,heads,dims,dtype,has_init", [
        ([CHUNK_SIZE + 1], (1, 2), (128, 128), torch.bfloat16, [True]),  # Qwen3-Next's head dims: two K tiles
        ([0, CHUNK_SIZE + 2], (1, 1), (100, 48), torch.float32, [True, True]),  # dims off powers of two
    ], ids=["head_dim_128", "odd_head_dims"])
    def test_matches_reference_at_wide_heads(self, device, lens, heads, dims, dtype, has_init):
        check_rule("chunked_gated_delta_rule", lens, heads, dims, dtype, device, has_init)

    def test_prompt_split_across_calls_equals_one_call(self, device):
        whole = gdn_inputs([CHUNK_SIZE + 8], 1, 2, 16, 16, has_init=[False], device=device)
        o_whole = run_rule(triton_ops.chunk_gated_delta_rule, whole)
        parts = gdn_inputs([CHUNK_SIZE + 8], 1, 2, 16, 16, has_init=[False], device=device)
        for span, has_init in ((slice(0, 40), False), (slice(40, CHUNK_SIZE + 8), True)):
            piece = parts._replace(q=parts.q[span], k=parts.k[span], v=parts.v[span], g=parts.g[span],
                                   beta=parts.beta[span], cu_seqlens=cu_seqlens_of([span.stop - span.start], device),
                                   has_initial_state=torch.tensor([has_init], device=device))
            assert rel_err(run_rule(triton_ops.chunk_gated_delta_rule, piece).cpu(), o_whole[span].cpu()) < 1e-4
        assert rel_err(parts.state.cpu(), whole.state.cpu()) < 1e-5

    def test_each_kernel_matches_its_torch_stage(self, device):
        check_stages([CHUNK_SIZE + 5, 0, 3], (1, 2), (96, 48), torch.float32, device, [True, True, False])

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("key_bias", [0.0, 3.0], ids=["random_keys", "aligned_keys"])
    @pytest.mark.parametrize("lens,dims", [
        ([1], (16, 16)),
        ([17], (16, 16)),
        ([CHUNK_SIZE], (32, 16)),
        ([2 * CHUNK_SIZE + 17, 1, 40], (96, 48)),  # full chunks, then partial ones; two K tiles
    ], ids=["len_1", "len_17", "one_chunk", "partial_last_chunks"])
    def test_prep_kernel_matches_a_triangular_solve(self, device, dtype, key_bias, lens, dims):
        check_prep(lens, (1, 2), dims, dtype, device, key_bias)

    @pytest.mark.gpu
    @pytest.mark.parametrize("lens", [[1, CHUNK_SIZE - 1, CHUNK_SIZE, CHUNK_SIZE + 1, 1000], [4096]], ids=str)
    def test_qwen3_next_shapes(self, lens):
        in_fresh_process("check_rule", "chunk_gated_delta_rule", lens, QWEN3_NEXT_HEADS, QWEN3_NEXT_DIMS,
                         torch.bfloat16, "cuda")

    @pytest.mark.gpu
    @pytest.mark.parametrize("lens,heads", [([CHUNK_SIZE + 1], (1, 1)),
                                            ([1, CHUNK_SIZE - 1, CHUNK_SIZE, CHUNK_SIZE + 1, 1000], QWEN3_NEXT_HEADS)],
                             ids=["one_head", "qwen3_next_heads"])
    def test_each_kernel_at_qwen3_next_head_dims(self, lens, heads):
        in_fresh_process("check_stages", lens, heads, QWEN3_NEXT_DIMS, torch.bfloat16, "cuda")

    def test_keys_wider_than_two_tiles_take_the_recurrent_kernel(self, monkeypatch):
        calls = []
        monkeypatch.setattr(gated_delta, "chunked_gated_delta_rule", lambda *a, **k: calls.append("chunked"))
        monkeypatch.setattr(gated_delta, "fused_recurrent_gated_delta_rule", lambda *a, **k: calls.append("recurrent"))
        for dim in (gated_delta.CHUNK_MAX_K_DIM, 2 * gated_delta.CHUNK_MAX_K_DIM):
            x = gdn_inputs([3], 1, 2, dim, 16, dtype=torch.float32)
            run_rule(gated_delta.chunk_gated_delta_rule, x)
        assert calls == ["chunked", "recurrent"]

    def test_chunked_kernels_refuse_wider_keys(self):
        x = gdn_inputs([3], 1, 1, 2 * gated_delta.CHUNK_MAX_K_DIM, 16, dtype=torch.float32)
        with pytest.raises(ValueError, match="key heads up to 128"):
            run_rule(gated_delta.chunked_gated_delta_rule, x)


class TestChunkLayout:
    def test_numbers_chunks_sequence_by_sequence(self):
        lens = [0, 2 * CHUNK_SIZE + 1, 3, CHUNK_SIZE, 0]
        layout = gated_delta.chunk_layout(cu_seqlens_of(lens), sum(lens))
        want_bounds, want_first, start = [], [], 0
        for n in lens:
            want_first.append(len(want_bounds))
            want_bounds += [[c, min(c + CHUNK_SIZE, start + n)] for c in range(start, start + n, CHUNK_SIZE)]
            start += n
        bounds = layout.bounds.tolist()
        assert len(bounds) == sum(lens) // CHUNK_SIZE + len(lens)
        assert bounds[:len(want_bounds)] == want_bounds
        assert all(b == [0, 0] for b in bounds[len(want_bounds):])
        assert layout.first_chunk.tolist() == want_first


class TestFusedRecurrentGatedDeltaRule:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("lens,heads,dims", [([1, 1, 3], (1, 2), (16, 24)), ([2, 1], (2, 2), (16, 24)),
                                                 ([1, 2], (1, 2), (16, 48))], ids=["hv_2hk", "hv_hk", "two_v_blocks"])
    def test_matches_reference(self, device, dtype, lens, heads, dims):
        check_rule("fused_recurrent_gated_delta_rule", lens, heads, dims, dtype, device)

    @pytest.mark.parametrize("name", RULES)
    def test_empty_sequence_and_negative_slot_leave_the_pool_alone(self, device, name):
        x = gdn_inputs([2, 0, 1], 1, 1, 16, 16, has_init=[True, True, True], device=device)
        x = x._replace(state_indices=torch.tensor([1, 3, -1], dtype=torch.int32, device=device))
        ref = gdn_inputs([2, 0, 1], 1, 1, 16, 16, has_init=[True, True, True])
        ref = ref._replace(state_indices=torch.tensor([1, 3, -1], dtype=torch.int32))
        out = run_rule(getattr(triton_ops, name, None) or getattr(gated_delta, name), x)
        assert rel_err(out.cpu(), run_rule(torch_ref.fused_recurrent_gated_delta_rule, ref)) < 1e-4
        assert rel_err(x.state.cpu(), ref.state) < 1e-5 and torch.equal(x.state[2:].cpu(), ref.state[2:])

    @pytest.mark.gpu
    def test_qwen3_next_decode_batch(self):
        in_fresh_process("check_rule", "fused_recurrent_gated_delta_rule", [1] * 32 + [3, 2], QWEN3_NEXT_HEADS,
                         QWEN3_NEXT_DIMS, torch.bfloat16, "cuda", [True] * 34)


def check_conv(lens, channels, width, dtype, device, has_init=None, activation="silu"):
    args = conv_inputs(lens, channels, width, dtype, has_init=has_init)
    dev_args = tuple(t.to(device, copy=True) for t in args)  # the kernel must not see the reference's state
    y = triton_ops.causal_conv1d(*dev_args, activation)
    if device == "cuda":
        torch.cuda.synchronize()
    want = torch_ref.causal_conv1d(*args, activation)
    assert y.dtype == dtype and rel_err(y.cpu(), want) < TOL[dtype]
    assert torch.equal(dev_args[3].cpu(), args[3])  # states are copies of inputs: exact


class TestCausalConv1d:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("activation", ["silu", None])
    def test_prefill_matches_reference(self, device, dtype, activation):
        check_conv([1, 7, 20, 2], 24, 4, dtype, device, activation=activation)

    def test_decode_and_empty_sequences(self, device):
        check_conv([1, 1, 0, 1], 40, 4, torch.float32, device, has_init=[True, False, True, True])

    def test_negative_slot_runs_from_zeros_and_writes_nothing(self, device):
        args = conv_inputs([3, 2], 8, 3, has_init=[True, True])
        args = args[:4] + (torch.tensor([1, -1], dtype=torch.int32),) + args[5:]
        dev_args = tuple(t.to(device, copy=True) for t in args)  # the kernel must not see the reference's state
        y = triton_ops.causal_conv1d(*dev_args)
        assert rel_err(y.cpu(), torch_ref.causal_conv1d(*args)) < 1e-5
        assert torch.equal(dev_args[3].cpu(), args[3])

    @pytest.mark.gpu
    @pytest.mark.parametrize("lens,has_init", [([1, 2, 3, 100, 1000], None), ([1] * 32, [True] * 32)],
                             ids=["prefill", "decode"])
    def test_qwen3_next_shapes(self, lens, has_init):
        in_fresh_process("check_conv", lens, QWEN3_NEXT_CONV_CHANNELS, QWEN3_NEXT["conv_width"], torch.bfloat16,
                         "cuda", has_init)


class TestGatedRmsNorm:
    @pytest.mark.parametrize("dtype,weight_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                    (torch.bfloat16, torch.float32)])
    def test_matches_reference_on_a_strided_gate(self, device, dtype, weight_dtype):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(5, 3, 24, generator=gen).to(dtype)
        z = torch.randn(5, 3, 48, generator=gen).to(dtype)[..., :24]  # a view into a wider projection
        weight = torch.randn(24, generator=gen).to(weight_dtype)
        y = triton_ops.gated_rms_norm(x.to(device), z.to(device), weight.to(device), 1e-6)
        assert y.dtype == dtype and rel_err(y.cpu(), torch_ref.gated_rms_norm(x, z, weight, 1e-6)) < TOL[dtype]

    @pytest.mark.gpu
    def test_qwen3_next_shapes(self):
        in_fresh_process("check_gated_norm_at_qwen3_next_shapes")


def check_gated_norm_at_qwen3_next_shapes():
    x, z = (torch.randn(4096 * QWEN3_NEXT["num_v_heads"], QWEN3_NEXT["v_dim"], dtype=torch.bfloat16)
            for _ in range(2))
    weight = torch.randn(QWEN3_NEXT["v_dim"], dtype=torch.bfloat16)
    y = triton_ops.gated_rms_norm(x.cuda(), z.cuda(), weight.cuda(), 1e-6)
    torch.cuda.synchronize()
    assert rel_err(y.cpu(), torch_ref.gated_rms_norm(x, z, weight, 1e-6)) < 5e-3


# ---------------------------------------------------------------------------------------------
# offline sm_90 compile of the chunk kernels at their launch shapes

_POINTER_TYPES = {"g_ptr": "*fp32", "state_ptr": "*fp32", "chunk_bounds_ptr": "*i32", "idx_ptr": "*i32",
                  "cu_ptr": "*i32", "has_init_ptr": "*i1", "first_chunk_ptr": "*i32"}
CHUNK_KERNELS = {  # name: (kernel, its ChunkShapes field for BV)
    "prep": ("_gdn_chunk_prep_kernel", "prep_block_v"),
    "state": ("_gdn_chunk_state_kernel", "state_block_v"),
    "output": ("_gdn_chunk_output_kernel", "output_block_v"),
}


def compile_chunk_kernel_for_hopper(kernel: str, heads, dims):
    """The chunk kernel compiled for sm_90 (bf16 q/k/v) with the wrapper's constexprs, warps and stages,
    and the 16-divisibility Triton gives pointers and strides at launch."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    name, block_v = CHUNK_KERNELS[kernel]
    fn = getattr(gated_delta, name)
    consts = {**gated_delta.chunk_constexprs(*heads, *dims, torch.bfloat16, True),
              "BV": getattr(gated_delta.chunk_shapes(*dims), block_v)}
    sig = {name: (_POINTER_TYPES.get(name, "*bf16") if name.endswith("_ptr") else "fp32" if name == "scale" else "i32")
           for name in fn.arg_names if name not in consts}
    aligned = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items()
               if t.startswith("*") or a.startswith("stride")}
    src = ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in consts}}, constexprs=consts, attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": gated_delta.CHUNK_NUM_WARPS, "num_stages": 2})


def overhanging_dots(ttgir: str) -> list[str]:
    """wgmma dots whose warp layout spans more rows or columns than the dot's result tile: the extra
    warpgroup's share of the product lies outside its operands. (Register-operand mma.sync dots on
    tiles below 64 rows simply repeat across warps; the small-shape GPU tests pass with those.)"""
    layouts = {m[1]: tuple(int(x) for x in m.groups()[1:]) for m in re.finditer(
        r"^(#mma\d*) = #ttg\.nvidia_mma<\{versionMajor = 3,[^}]*warpsPerCTA = \[(\d+), (\d+)\], "
        r"instrShape = \[(\d+), (\d+), \d+\]", ttgir, re.MULTILINE)}
    bad = []
    for m in re.finditer(r"warp_group_dot .*-> tensor<(\d+)x(\d+)x\w+, (#mma\d*)>", ttgir):
        rows, cols = int(m[1]), int(m[2])
        warps_m, warps_n, instr_m, instr_n = layouts[m[3]]
        if warps_m * instr_m > rows or warps_n * instr_n > cols:
            bad.append(f"{rows}x{cols} dot with {m[3]} = warps [{warps_m}, {warps_n}] x instr [{instr_m}, {instr_n}]")
    return bad


def stack_bytes(cubin: bytes, tmp_path: Path) -> int:
    """Per-thread stack (register spills) of the kernel in cubin, read with the cuobjdump Triton ships."""
    path = tmp_path / "kernel.cubin"
    path.write_bytes(cubin)
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    usage = subprocess.run([str(tool), "-res-usage", str(path)], capture_output=True, text=True, check=True).stdout
    return int(re.search(r"STACK:(\d+)", usage)[1])


@pytest.mark.skipif(INTERPRET, reason="the interpreter replaces the compiled kernels")
@pytest.mark.parametrize("heads,dims", [((1, 2), (16, 16)), (QWEN3_NEXT_HEADS, QWEN3_NEXT_DIMS)],
                         ids=["small", "qwen3_next"])
@pytest.mark.parametrize("kernel", list(CHUNK_KERNELS))
def test_chunk_kernels_compile_for_hopper_to_64_row_dots_without_spills(kernel, heads, dims, tmp_path):
    """Every wgmma has 64 rows and one warpgroup's layout, no operand is transposed in registers or read
    back with ldmatrix.trans (the first chunk kernels' state update did both and was wrong on the H200 from
    key width 64 up; see gated_delta's docstring), and nothing spills."""
    compiled = compile_chunk_kernel_for_hopper(kernel, heads, dims)
    ttgir = compiled.asm["ttgir"]
    dot_rows = {int(m[1]) for m in re.finditer(r"warp_group_dot .*-> tensor<(\d+)x", ttgir)}
    assert dot_rows == {CHUNK_SIZE}, "the chunk dots should be 64-row warpgroup MMAs"
    assert overhanging_dots(ttgir) == []
    assert "tt.trans" not in ttgir, "k^T is loaded transposed, not transposed in registers"
    if " tt.dot " not in ttgir:  # mma.sync dots (below 64 rows) read operands with ldmatrix.trans and pass
        assert ".trans" not in "".join(re.findall(r"ldmatrix\S*", compiled.asm["ptx"])), \
            "no wgmma operand read back from a column-major shared tile (benchmarks/kernels/gdn_transpose_dot_probe.py)"
    assert stack_bytes(compiled.asm["cubin"], tmp_path) == 0
