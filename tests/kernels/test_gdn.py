"""The gated-DeltaNet torch references (kernels/gdn_ref.py) against HF transformers' own Qwen3-Next
functions, on random packed inputs: several sequences of different lengths (below, at and above the
chunk size), Hv = Hk and Hv = 2 Hk, with and without an initial state, and a prompt split across calls.
The helpers here also build the inputs of the Triton tests (test_gdn_triton.py)."""
from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from atom_core.kernels import torch_ref
from atom_core.kernels.gdn_ref import CHUNK_SIZE

DELTA_RULES = [torch_ref.chunk_gated_delta_rule, torch_ref.fused_recurrent_gated_delta_rule]


class GdnInputs(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    state: torch.Tensor  # [num_slots, Hv, Dk, Dv] float32 pool
    state_indices: torch.Tensor
    cu_seqlens: torch.Tensor
    has_initial_state: torch.Tensor


def cu_seqlens_of(lens: list[int], device="cpu") -> torch.Tensor:
    return torch.tensor([0] + lens, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)


def gdn_inputs(lens, num_k_heads, num_v_heads, k_dim, v_dim, dtype=torch.float32, has_init=None, seed=0,
               device="cpu") -> GdnInputs:
    """Random inputs as a Qwen3-Next layer makes them; sequence i uses slot 2*i + 1 of a pool with
    spare slots, so a kernel that writes the wrong slot is caught."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens, num_seqs = sum(lens), len(lens)

    def randn(*shape, dt=torch.float32):
        return torch.randn(*shape, generator=gen).to(dt)

    q, k = randn(num_tokens, num_k_heads, k_dim, dt=dtype), randn(num_tokens, num_k_heads, k_dim, dt=dtype)
    v = randn(num_tokens, num_v_heads, v_dim, dt=dtype)
    g = -randn(num_v_heads).exp() * F.softplus(randn(num_tokens, num_v_heads) + 0.5)  # -exp(A_log) softplus(a+dt)
    beta = torch.sigmoid(randn(num_tokens, num_v_heads)).to(dtype)
    state = randn(2 * num_seqs + 1, num_v_heads, k_dim, v_dim) * 0.1
    has_init = [i % 2 == 1 for i in range(num_seqs)] if has_init is None else has_init
    tensors = GdnInputs(q, k, v, g, beta, state, torch.arange(1, 2 * num_seqs, 2, dtype=torch.int32),
                        cu_seqlens_of(lens), torch.tensor(has_init, dtype=torch.bool))
    return GdnInputs(*(t.to(device) for t in tensors))


def run_rule(op, x: GdnInputs, **kw) -> torch.Tensor:
    return op(*x, scale=x.q.shape[-1] ** -0.5, **kw)


def hf_rule(hf_fn, x: GdnInputs):
    """HF's function on each sequence alone (batch 1): the outputs concatenated and the final states."""
    outs, states = [], {}
    bounds = x.cu_seqlens.tolist()
    for i, slot in enumerate(x.state_indices.tolist()):
        span = slice(bounds[i], bounds[i + 1])
        init = x.state[slot][None] if x.has_initial_state[i] else None
        o, s = hf_fn(x.q[span][None], x.k[span][None], x.v[span][None], x.g[span][None], x.beta[span][None],
                     initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True)
        outs.append(o[0])
        states[slot] = s[0]
    return torch.cat(outs), states


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


SHAPES = [  # lens, Hk, Hv, Dk, Dv
    ([5], 2, 2, 8, 8),
    ([CHUNK_SIZE, 3, CHUNK_SIZE + 7], 2, 4, 16, 8),
    ([2 * CHUNK_SIZE + 1, 1, 17], 1, 2, 8, 16),
]


class TestGatedDeltaRuleReference:
    @pytest.mark.parametrize("op", DELTA_RULES, ids=["chunk", "recurrent"])
    @pytest.mark.parametrize("hf_fn", [hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule],
                             ids=["hf_chunk", "hf_recurrent"])
    @pytest.mark.parametrize("shape", SHAPES, ids=str)
    def test_matches_hf_on_packed_sequences(self, op, hf_fn, shape):
        x = gdn_inputs(*shape)
        want_o, want_states = hf_rule(hf_fn, x)
        untouched = x.state[0].clone()
        o = run_rule(op, x)
        assert o.dtype == x.v.dtype and o.shape == x.v.shape
        assert rel_err(o, want_o) < 1e-5
        for slot, s in want_states.items():
            assert rel_err(x.state[slot], s) < 1e-5
        assert torch.equal(x.state[0], untouched)

    @pytest.mark.parametrize("op", DELTA_RULES, ids=["chunk", "recurrent"])
    def test_bf16_inputs_match_hf(self, op):
        x = gdn_inputs([CHUNK_SIZE + 9, 4], 2, 4, 16, 16, dtype=torch.bfloat16)
        want_o, _ = hf_rule(hf.torch_recurrent_gated_delta_rule, x)
        o = run_rule(op, x)
        assert o.dtype == torch.bfloat16 and rel_err(o, want_o) < 1e-2

    @pytest.mark.parametrize("op", DELTA_RULES, ids=["chunk", "recurrent"])
    @pytest.mark.parametrize("split", [1, CHUNK_SIZE - 1, CHUNK_SIZE, CHUNK_SIZE + 5])
    def test_prompt_split_across_calls_equals_one_call(self, op, split):
        total = 2 * CHUNK_SIZE + 3
        whole = gdn_inputs([total, 9], 2, 4, 8, 8, has_init=[False, True])
        o_whole = run_rule(op, whole)
        parts = gdn_inputs([total, 9], 2, 4, 8, 8, has_init=[False, True])
        for first, lens, has_init in ((True, [split, 4], [False, True]), (False, [total - split, 5], [True, True])):
            rows = [torch.arange(0, split) if first else torch.arange(split, total),
                    total + (torch.arange(0, 4) if first else torch.arange(4, 9))]
            rows = torch.cat(rows)
            piece = parts._replace(q=parts.q[rows], k=parts.k[rows], v=parts.v[rows], g=parts.g[rows],
                                   beta=parts.beta[rows], cu_seqlens=cu_seqlens_of(lens),
                                   has_initial_state=torch.tensor(has_init))
            o_piece = run_rule(op, piece)
            assert rel_err(o_piece, o_whole[rows]) < 1e-5
        assert rel_err(parts.state, whole.state) < 1e-5

    @pytest.mark.parametrize("op", DELTA_RULES, ids=["chunk", "recurrent"])
    def test_empty_sequence_and_negative_slot_leave_the_pool_alone(self, op):
        x = gdn_inputs([6, 0, 4], 1, 1, 8, 8, has_init=[True, True, True])
        x = x._replace(state_indices=torch.tensor([1, 3, -1], dtype=torch.int32))
        before = x.state.clone()
        o = run_rule(op, x)
        fresh = x._replace(state=before.clone(), state_indices=torch.tensor([1, 3, 5], dtype=torch.int32),
                           has_initial_state=torch.tensor([True, True, False]))
        assert torch.allclose(o, run_rule(op, fresh), atol=1e-6)  # slot -1 ran from zeros
        assert torch.equal(x.state[2:], before[2:]) and torch.equal(x.state[0], before[0])

    def test_rejects_v_heads_not_a_multiple_of_k_heads(self):
        x = gdn_inputs([3], 2, 3, 8, 8)
        with pytest.raises(ValueError, match="multiple"):
            run_rule(torch_ref.chunk_gated_delta_rule, x)


def conv_inputs(lens, channels, width, dtype=torch.float32, has_init=None, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    num_seqs = len(lens)
    x = torch.randn(sum(lens), channels, generator=gen).to(dtype)
    weight = torch.randn(channels, width, generator=gen).to(dtype)
    bias = torch.randn(channels, generator=gen).to(dtype)
    conv_state = torch.randn(2 * num_seqs + 1, channels, width - 1, generator=gen).to(dtype)
    has_init = [i % 2 == 1 for i in range(num_seqs)] if has_init is None else has_init
    tensors = (x, weight, bias, conv_state, torch.arange(1, 2 * num_seqs, 2, dtype=torch.int32),
               cu_seqlens_of(lens), torch.tensor(has_init, dtype=torch.bool))
    return tuple(t.to(device) for t in tensors)


def hf_conv(x, weight, bias, conv_state, state_indices, cu_seqlens, has_initial_state, activation):
    """HF's prefill conv for sequences without a state, HF's decode update (a state of W inputs,
    the oldest one unused) token by token for those with one."""
    outs, bounds = [], cu_seqlens.tolist()
    for i, slot in enumerate(state_indices.tolist()):
        xs = x[bounds[i]:bounds[i + 1]].t()[None]  # [1, C, L]
        if has_initial_state[i]:
            state = torch.cat([torch.zeros_like(conv_state[slot][:, :1]), conv_state[slot]], dim=1)[None]
            outs.append(torch.cat([hf.causal_conv1d_update(xs[:, :, t:t + 1], state, weight, bias, activation)
                                   for t in range(xs.shape[2])], dim=2)[0].t())
        else:
            outs.append(hf.causal_conv1d_fn(xs, weight, bias, activation)[0].t())
    return torch.cat(outs)


class TestCausalConv1dReference:
    @pytest.mark.parametrize("activation", ["silu", None])
    @pytest.mark.parametrize("lens", [[1], [7, 2, 1], [3, 20]], ids=str)
    def test_matches_hf(self, lens, activation):
        args = conv_inputs(lens, 6, 4)
        want = hf_conv(*args, activation)
        y = torch_ref.causal_conv1d(*args, activation)
        assert rel_err(y, want) < 1e-5

    def test_state_holds_the_last_inputs_and_split_equals_one_call(self):
        x, weight, bias, state, slots, _, _ = conv_inputs([10], 5, 4, has_init=[True])
        start = state.clone()
        whole = torch_ref.causal_conv1d(x, weight, bias, state, slots, cu_seqlens_of([10]), torch.tensor([True]))
        whole_state = state.clone()
        state.copy_(start)
        pieces = [torch_ref.causal_conv1d(x[a:b], weight, bias, state, slots, cu_seqlens_of([b - a]),
                                          torch.tensor([True])) for a, b in ((0, 2), (2, 3), (3, 10))]
        assert rel_err(torch.cat(pieces), whole) < 1e-6
        assert torch.equal(state, whole_state) and torch.equal(whole_state[1], x[-3:].t())
        # A one-token step keeps the two newest older inputs.
        torch_ref.causal_conv1d(x[:1], weight, bias, state, slots, cu_seqlens_of([1]), torch.tensor([True]))
        assert torch.equal(state[1], torch.cat([x[-2:], x[:1]]).t())

    def test_rejects_unknown_activation(self):
        with pytest.raises(ValueError, match="'silu', None"):
            torch_ref.causal_conv1d(*conv_inputs([2], 4, 4), "gelu")


class TestGatedRmsNormReference:
    @pytest.mark.parametrize("dtype,weight_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                    (torch.bfloat16, torch.float32)])
    def test_matches_hf_exactly(self, dtype, weight_dtype):
        gen = torch.Generator().manual_seed(0)
        x, z = (torch.randn(7, 32, generator=gen).to(dtype) for _ in range(2))
        module = hf.Qwen3NextRMSNormGated(32, eps=1e-6)
        with torch.no_grad():
            module.weight.copy_(torch.randn(32, generator=gen))
        module = module.to(weight_dtype)
        y = torch_ref.gated_rms_norm(x, z, module.weight.data, 1e-6)
        assert y.dtype == dtype and torch.equal(y, module(x, z))
