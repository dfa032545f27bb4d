"""The gated-DeltaNet Triton kernels against their torch references (kernels/gdn_ref.py, itself checked
against HF in test_gdn.py) on fresh random packed inputs: small shapes on both devices (the CPU runs
Triton's interpreter), Qwen3-Next's shapes on CUDA only."""
from __future__ import annotations

import pytest
import torch

from atom_core.kernels import torch_ref
from atom_core.kernels import triton as triton_ops
from atom_core.kernels.gdn_ref import CHUNK_SIZE
from tests.kernels.test_gdn import conv_inputs, cu_seqlens_of, gdn_inputs, rel_err, run_rule

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
RULES = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]
# Qwen3-Next-80B-A3B: 16 q/k heads, 32 v heads, head dims 128, conv width 4 over q, k and v channels.
QWEN3_NEXT = dict(num_k_heads=16, num_v_heads=32, k_dim=128, v_dim=128, conv_width=4)


def check_rule(name, lens, heads, dims, dtype, device, has_init=None, seed=0):
    """Runs the kernel and the reference on the same inputs; compares outputs and the whole pool."""
    x = gdn_inputs(lens, *heads, *dims, dtype=dtype, has_init=has_init, seed=seed, device=device)
    ref = gdn_inputs(lens, *heads, *dims, dtype=dtype, has_init=has_init, seed=seed)
    out = run_rule(getattr(triton_ops, name), x)
    want = run_rule(torch_ref.fused_recurrent_gated_delta_rule, ref)
    assert out.dtype == dtype and out.shape == want.shape
    assert rel_err(out.cpu(), want) < TOL[dtype]
    assert rel_err(x.state.cpu(), ref.state) < TOL[dtype]
    untouched = torch.ones(ref.state.shape[0], dtype=torch.bool)
    untouched[ref.state_indices.long()] = False
    assert torch.equal(x.state.cpu()[untouched], ref.state[untouched])


class TestChunkGatedDeltaRule:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("lens,heads,dims,has_init", [
        ([5, CHUNK_SIZE], (1, 2), (16, 16), [False, True]),  # below and at the chunk size, Hv = 2 Hk
        ([CHUNK_SIZE + 6, 3], (1, 1), (16, 32), [True, False]),  # above it, Hv = Hk
    ], ids=["short_and_one_chunk", "two_chunks"])
    def test_matches_reference(self, device, dtype, lens, heads, dims, has_init):
        check_rule("chunk_gated_delta_rule", lens, heads, dims, dtype, device, has_init)

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

    @pytest.mark.gpu
    @pytest.mark.parametrize("lens", [[1, CHUNK_SIZE - 1, CHUNK_SIZE, CHUNK_SIZE + 1, 1000], [4096]], ids=str)
    def test_qwen3_next_shapes(self, lens):
        shape = QWEN3_NEXT
        check_rule("chunk_gated_delta_rule", lens, (shape["num_k_heads"], shape["num_v_heads"]),
                   (shape["k_dim"], shape["v_dim"]), torch.bfloat16, "cuda")


class TestFusedRecurrentGatedDeltaRule:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("lens,heads", [([1, 1, 3], (1, 2)), ([2, 1], (2, 2))], ids=["hv_2hk", "hv_hk"])
    def test_matches_reference(self, device, dtype, lens, heads):
        check_rule("fused_recurrent_gated_delta_rule", lens, heads, (16, 24), dtype, device)

    @pytest.mark.parametrize("name", RULES)
    def test_empty_sequence_and_negative_slot_leave_the_pool_alone(self, device, name):
        x = gdn_inputs([2, 0, 1], 1, 1, 16, 16, has_init=[True, True, True], device=device)
        x = x._replace(state_indices=torch.tensor([1, 3, -1], dtype=torch.int32, device=device))
        ref = gdn_inputs([2, 0, 1], 1, 1, 16, 16, has_init=[True, True, True])
        ref = ref._replace(state_indices=torch.tensor([1, 3, -1], dtype=torch.int32))
        out = run_rule(getattr(triton_ops, name), x)
        assert rel_err(out.cpu(), run_rule(torch_ref.fused_recurrent_gated_delta_rule, ref)) < 1e-4
        assert rel_err(x.state.cpu(), ref.state) < 1e-5 and torch.equal(x.state[2:].cpu(), ref.state[2:])

    @pytest.mark.gpu
    def test_qwen3_next_decode_batch(self):
        shape = QWEN3_NEXT
        check_rule("fused_recurrent_gated_delta_rule", [1] * 32 + [3, 2], (shape["num_k_heads"], shape["num_v_heads"]),
                   (shape["k_dim"], shape["v_dim"]), torch.bfloat16, "cuda", has_init=[True] * 34)


def check_conv(lens, channels, width, dtype, device, has_init=None, activation="silu"):
    args = conv_inputs(lens, channels, width, dtype, has_init=has_init)
    dev_args = tuple(t.to(device, copy=True) for t in args)  # the kernel must not see the reference's state
    y = triton_ops.causal_conv1d(*dev_args, activation)
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
    def test_qwen3_next_shapes(self):
        shape = QWEN3_NEXT
        channels = 2 * shape["num_k_heads"] * shape["k_dim"] + shape["num_v_heads"] * shape["v_dim"]
        check_conv([1, 2, 3, 100, 1000], channels, shape["conv_width"], torch.bfloat16, "cuda")
        check_conv([1] * 32, channels, shape["conv_width"], torch.bfloat16, "cuda", has_init=[True] * 32)


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
        x, z = (torch.randn(4096 * QWEN3_NEXT["num_v_heads"], QWEN3_NEXT["v_dim"], dtype=torch.bfloat16)
                for _ in range(2))
        weight = torch.randn(QWEN3_NEXT["v_dim"], dtype=torch.bfloat16)
        y = triton_ops.gated_rms_norm(x.cuda(), z.cuda(), weight.cuda(), 1e-6)
        assert rel_err(y.cpu(), torch_ref.gated_rms_norm(x, z, weight, 1e-6)) < 5e-3
