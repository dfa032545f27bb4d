"""The LoRA shrink/expand Triton kernels against their torch references (Triton's interpreter on the
CPU, tests/conftest.py), and the grouped layout."""
from __future__ import annotations

import os
import re

import pytest
import torch

from atom_core.kernels import lora_ref
from atom_core.kernels.triton import lora as triton_lora


def _case(num_tokens: int, k: int, slots: int, rank: int, slice_sizes: list[int], device: str, dtype=torch.float32,
          seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, k, generator=g).to(device, dtype)
    a = torch.randn(slots, len(slice_sizes) * rank, k, generator=g).to(device, dtype)
    b = torch.randn(slots, sum(slice_sizes), rank, generator=g).to(device, dtype)
    y = torch.randn(num_tokens, sum(slice_sizes), generator=g).to(device, dtype)
    token_slots = torch.randint(-1, slots, (num_tokens,), generator=g).to(device, torch.int32)
    offsets = (0, *torch.tensor(slice_sizes).cumsum(0).tolist())
    return x, a, b, y, token_slots, tuple(offsets)


class TestLayout:
    def test_groups_tokens_by_slot_and_counts_each(self):
        meta = lora_ref.lora_layout(torch.tensor([1, -1, 0, 1, 2, -1, 0], dtype=torch.int32), 4)
        assert meta.slot_num_tokens.tolist() == [2, 2, 1, 0]
        assert meta.slot_start.tolist() == [0, 2, 4, 5]
        assert meta.sorted_token_ids.tolist()[:5] == [2, 6, 0, 3, 4]  # stable within a slot; no-adapter rows last


class TestReferences:
    def test_shrink_and_expand_match_a_per_token_loop(self):
        x, a, b, y, token_slots, offsets = _case(9, 12, 3, 4, [5, 3], "cpu")
        meta = lora_ref.lora_layout(token_slots, 3)
        v = lora_ref.lora_shrink(x, a, meta)
        out = y.clone()
        lora_ref.lora_expand(out, v, b, meta, offsets, 4)
        for t in range(9):
            s = int(token_slots[t])
            want = y[t].clone()
            if s >= 0:
                for i, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
                    want[lo:hi] += b[s, lo:hi] @ (a[s, i * 4:(i + 1) * 4] @ x[t])
            torch.testing.assert_close(out[t], want)


# Small fp32 cases under the interpreter; on a CUDA machine test_real_shapes_on_gpu checks the compiled
# kernels (in bf16: tl.dot rounds fp32 inputs to tf32 there, beyond these cases' tolerance).
interpreter_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter cases")


@interpreter_only
@pytest.mark.parametrize("num_tokens,k,slots,rank,slices", [
    (7, 40, 3, 8, [24]),            # one slice, ragged K and N
    (20, 64, 2, 16, [32, 16, 16]),  # qkv-like, tokens over one block per slot
    (5, 48, 4, 4, [40, 40]),        # gate_up-like, a slice wider than one N block
    (6, 1100, 2, 4, [8]),           # K split in two (decode-sized steps): partials summed by the expand
])
class TestTritonMatchesReference:
    def test_shrink(self, num_tokens, k, slots, rank, slices):
        x, a, _, _, token_slots, _ = _case(num_tokens, k, slots, rank, slices, "cpu")
        meta = lora_ref.lora_layout(token_slots, slots)
        got = triton_lora.lora_shrink(x, a, meta)
        want = lora_ref.lora_shrink(x, a, meta)
        rows = token_slots >= 0
        torch.testing.assert_close(got.sum(0)[rows], want.sum(0)[rows], rtol=1e-4, atol=1e-4)

    def test_expand(self, num_tokens, k, slots, rank, slices):
        x, a, b, y, token_slots, offsets = _case(num_tokens, k, slots, rank, slices, "cpu")
        meta = lora_ref.lora_layout(token_slots, slots)
        got, want = y.clone(), y.clone()
        # The Triton shrink's partials (rows of no adapter left unwritten), summed by the expand.
        triton_lora.lora_expand(got, triton_lora.lora_shrink(x, a, meta), b, meta, offsets, rank)
        lora_ref.lora_expand(want, lora_ref.lora_shrink(x, a, meta), b, meta, offsets, rank)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # rows of no adapter untouched



@interpreter_only
@pytest.mark.parametrize("num_tokens", [1, 7, 32, 100])
@pytest.mark.parametrize("rank,slices", [(8, [48, 16, 16]), (16, [40]), (64, [24, 24])])
def test_default_plans_match_reference(num_tokens, rank, slices):
    """The default plans (K split into 5 one-step slices for the small steps, whole rows of a slot in
    one block) on fresh inputs, several adapters and rows of none: shrink then expand equals the
    references, and rows of no adapter stay as they were."""
    k, slots = 640, 5
    x, a, b, y, token_slots, offsets = _case(num_tokens, k, slots, rank, slices, "cpu", seed=num_tokens * 100 + rank)
    meta = lora_ref.lora_layout(token_slots, slots)
    v = triton_lora.lora_shrink(x, a, meta)
    assert v.shape[0] == triton_lora.shrink_plan(num_tokens, k, a.shape[1]).split_k
    rows = token_slots >= 0
    torch.testing.assert_close(v.sum(0)[rows], lora_ref.lora_shrink(x, a, meta)[0, rows], rtol=1e-4, atol=1e-3)
    got, want = y.clone(), y.clone()
    triton_lora.lora_expand(got, v, b, meta, offsets, rank)
    lora_ref.lora_expand(want, lora_ref.lora_shrink(x, a, meta), b, meta, offsets, rank)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    assert torch.equal(got[~rows], y[~rows])


@interpreter_only
@pytest.mark.parametrize("shrink,expand", [
    # a K loop masked at k_hi, 3 N blocks a program / one masked step a slice / no split, blocks past a slice
    (triton_lora.ShrinkPlan(16, 16, 64, 3, 200, 2), triton_lora.ExpandPlan(16, 16, 3, 2)),
    (triton_lora.ShrinkPlan(64, 32, 512, 2, 300, 1), triton_lora.ExpandPlan(64, 64, 1, 1)),
    (triton_lora.ShrinkPlan(16, 64, 128, 1, 520, 3), triton_lora.ExpandPlan(16, 16, 8, 1)),
])
def test_other_plans_match_reference(shrink, expand):
    """Plans other than the defaults (what benchmarks/kernels/lora_bench.py sweeps) stay exact,
    including K slices that are no multiple of BLOCK_K."""
    x, a, b, y, token_slots, offsets = _case(37, 520, 3, 16, [40, 24], "cpu", seed=7)
    meta = lora_ref.lora_layout(token_slots, 3)
    got, want = y.clone(), y.clone()
    triton_lora.lora_expand(got, triton_lora.lora_shrink(x, a, meta, shrink), b, meta, offsets, 16, expand)
    lora_ref.lora_expand(want, lora_ref.lora_shrink(x, a, meta), b, meta, offsets, 16)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


@interpreter_only
class TestTritonChecks:
    def test_expand_refuses_slices_that_do_not_cover_y(self):
        x, a, b, y, token_slots, offsets = _case(4, 16, 2, 4, [8, 8], "cpu")
        meta = lora_ref.lora_layout(token_slots, 2)
        v = lora_ref.lora_shrink(x, a, meta)
        with pytest.raises(ValueError, match="slice_offsets"):
            triton_lora.lora_expand(y, v, b, meta, (0, 8), 4)
        with pytest.raises(ValueError, match="must increase"):
            triton_lora.lora_expand(y, v, b, meta, (0, 16, 16), 4)

    @pytest.mark.parametrize("plan,match", [
        (triton_lora.ShrinkPlan(16, 16, 64, 2, 100, 1), "does not cover"),
        (triton_lora.ShrinkPlan(16, 16, 64, 64, 16, 1), "does not cover"),
        (triton_lora.ShrinkPlan(16, 24, 64, 1, 300, 1), "power of two"),
        (triton_lora.ShrinkPlan(16, 16, 64, 1, 300, 0), "num_stages"),
    ])
    def test_shrink_refuses_a_bad_plan(self, plan, match):
        x, a, _, _, token_slots, _ = _case(4, 300, 2, 4, [8], "cpu")
        with pytest.raises(ValueError, match=match):
            triton_lora.lora_shrink(x, a, lora_ref.lora_layout(token_slots, 2), plan)

    def test_expand_refuses_a_bad_plan_and_too_many_partials(self):
        x, a, b, y, token_slots, offsets = _case(4, 16, 2, 4, [8], "cpu")
        meta = lora_ref.lora_layout(token_slots, 2)
        v = lora_ref.lora_shrink(x, a, meta)
        with pytest.raises(ValueError, match="powers of two"):
            triton_lora.lora_expand(y, v, b, meta, offsets, 4, triton_lora.ExpandPlan(16, 48, 1, 1))
        with pytest.raises(ValueError, match="tiles and stages"):
            triton_lora.lora_expand(y, v, b, meta, offsets, 4, triton_lora.ExpandPlan(16, 16, 0, 1))
        with pytest.raises(ValueError, match="splits"):
            triton_lora.lora_expand(y, v.expand(triton_lora.MAX_SPLIT_K + 1, -1, -1).contiguous(), b, meta, offsets, 4)

    def test_refuses_a_layout_for_another_slot_count(self):
        x, a, _, _, token_slots, _ = _case(4, 16, 2, 4, [8], "cpu")
        with pytest.raises(ValueError, match="does not fit"):
            triton_lora.lora_shrink(x, a, lora_ref.lora_layout(token_slots, 3))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 7, 32, 100, 512, 4096])
def test_real_shapes_on_gpu(num_tokens):
    """Llama-3-8B's qkv (4096 -> 4096 + 2 x 1024) at rank 16 with 8 slots, in bf16, with A and B scaled
    as trained adapters are (x A^T and v B^T of the order of their inputs), so that bf16's rounding is
    measured against the size of what is added: the kernel rounds v to bf16 for its dot, the reference
    keeps it in float32, and both round the sum once."""
    x, a, b, y, token_slots, offsets = _case(num_tokens, 4096, 8, 16, [4096, 1024, 1024], "cuda", torch.bfloat16)
    a, b = a / 64, b / 4  # 1/sqrt(K), 1/sqrt(rank)
    meta = lora_ref.lora_layout(token_slots, 8)
    v = triton_lora.lora_shrink(x, a, meta)
    rows = token_slots >= 0
    torch.testing.assert_close(v.sum(0)[rows], lora_ref.lora_shrink(x, a, meta)[0, rows], rtol=2e-2, atol=2e-2)
    got, want = y.clone(), y.clone()
    triton_lora.lora_expand(got, v, b, meta, offsets, 16)
    lora_ref.lora_expand(want, v, b, meta, offsets, 16)
    scale = (want.float() - y.float()).abs().max().item()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * scale)
    torch.testing.assert_close(got[~rows], y[~rows], rtol=0, atol=0)  # rows of no adapter untouched


# ---- plans and the offline sm_90 compile (Triton's bundled ptxas; no GPU) --------------------------

LLAMA3_8B = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
             "down": (14336, (4096,))}  # projection: (K, output slices)


@pytest.mark.parametrize("name", list(LLAMA3_8B))
@pytest.mark.parametrize("num_tokens", [1, 32, 256])
def test_decode_plans_cover_k_in_one_step_a_program(name, num_tokens):
    """A small step splits K so that no program loops (its loads are one round trip), the slices
    cover K exactly once, and a block holds 16 rows of a slot (a decode batch's tokens of one adapter)."""
    k, slices = LLAMA3_8B[name]
    plan = triton_lora.shrink_plan(num_tokens, k, 16 * len(slices))
    assert plan.block_k >= plan.k_per_split and plan.num_stages == 1
    assert (plan.split_k - 1) * plan.k_per_split < k <= plan.split_k * plan.k_per_split
    assert plan.split_k <= triton_lora.MAX_SPLIT_K and plan.block_m == 16


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter replaces the compiled kernels")
@pytest.mark.parametrize("name", list(LLAMA3_8B))
@pytest.mark.parametrize("num_tokens", [32, 4096])
def test_kernels_compile_for_hopper_without_spills(name, num_tokens):
    """Both kernels at their default plans for Llama-3-8B's projections (rank 16, bf16) compile for
    sm_90 with Triton's bundled toolchain, spill nothing, and load 16 bytes a thread; a decode
    shrink (one step of K) loads straight to registers, staging nothing through cp.async."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tests.kernels.sm90_compile import cuobjdump_path, stack_bytes

    if cuobjdump_path() is None:
        pytest.skip("Triton ships no cuobjdump here")

    def compile_sm90(fn, sig, consts, aligned_ints, num_stages):
        aligned = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items()
                   if t.startswith("*") or a in aligned_ints}
        src = ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in consts}}, constexprs=consts, attrs=aligned)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": num_stages})

    k, slices = LLAMA3_8B[name]
    p = triton_lora.shrink_plan(num_tokens, k, 16 * len(slices))
    ints = ("N", "K", "K_PER_SPLIT", "stride_xm", "stride_al", "stride_an", "stride_vs", "stride_vm")
    sig = {"x_ptr": "*bf16", "a_ptr": "*bf16", "v_ptr": "*fp32", "sorted_ptr": "*i32", "count_ptr": "*i32",
           "start_ptr": "*i32", **{a: "i32" for a in ints}}
    shrink = compile_sm90(triton_lora._lora_shrink_kernel, sig, dict(
        SPLIT_K=p.split_k, BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k), ints[1:], p.num_stages)
    e = triton_lora.expand_plan(num_tokens, list(slices), 8)
    ints = ("o0", "o1", "o2", "o3", "RANK", "C1", "C2", "stride_vs", "stride_vm", "stride_bl", "stride_bn",
            "stride_ym")
    sig = {"v_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16", "sorted_ptr": "*i32", "count_ptr": "*i32",
           "start_ptr": "*i32", **{a: "i32" for a in ints}}
    expand = compile_sm90(triton_lora._lora_expand_kernel, sig, dict(
        SPLIT_K=p.split_k, BLOCK_S=triton.next_power_of_2(p.split_k), V_CHUNK=min(8, triton.next_power_of_2(p.split_k)),
        BLOCK_M=e.block_m, BLOCK_N=e.block_n, BLOCK_R=16, TILES=e.tiles), ints[4:5] + ints[7:], e.num_stages)
    for kernel in (shrink, expand):
        assert stack_bytes(kernel) == 0
        assert re.search(r"(ld\.global[.\w]*\.v4|cp\.async[.\w]* [^;]*, 0x10)", kernel.asm["ptx"])
    if p.num_stages == 1:
        assert "cp.async" not in shrink.asm["ptx"] and re.search(r"ld\.global[.\w]*\.v4", shrink.asm["ptx"])


def test_expand_plans_group_n_blocks_of_a_wide_layer_only():
    """At 8 slots and 32 tokens gate/up's 224 N blocks of 128 a slot are grouped (about
    EXPAND_PROGRAMS programs of the busy slots); q/k/v, o and down keep one block a program, and
    a step of one token (one busy slot) never groups."""
    wide = triton_lora.expand_plan(32, [14336, 14336], 8)
    assert wide.block_n == 128 and wide.tiles > 1 and wide.num_stages > 1
    programs = 8 * 2 * -(-14336 // (128 * wide.tiles))
    assert triton_lora.EXPAND_PROGRAMS <= programs < 2 * triton_lora.EXPAND_PROGRAMS
    for widths in ([4096, 1024, 1024], [4096]):
        assert triton_lora.expand_plan(32, widths, 8).tiles == 1
    assert triton_lora.expand_plan(1, [14336, 14336], 8).tiles == 1
