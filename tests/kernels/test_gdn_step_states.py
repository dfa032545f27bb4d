"""Verify steps' per-token states (kernels/gdn_ref.py `step_state` / `step_indices`): the state the
recurrent rule and the conv keep after token t of a sequence equals the final state of the same op run
on the sequence cut after t + 1 tokens; the Triton kernels (interpreted on the CPU) match the reference,
and a sequence with step row -1 keeps none."""
from __future__ import annotations

import pytest
import torch

from atom_core.kernels import torch_ref
from atom_core.kernels import triton as triton_ops
from tests.kernels.test_gdn import conv_inputs, gdn_inputs, rel_err, run_rule

LENS = [4, 1, 2]  # verify steps of 1 + 3 drafts, a plain decode, 1 + 1 drafts
STEPS = 3
HEADS, DIMS = (2, 4), (16, 16)
CHANNELS, WIDTH = 24, 4


def _step_rows():
    return torch.tensor([2, -1, 0], dtype=torch.int32)  # the middle sequence keeps none


def _rule_with_steps(op, device="cpu"):
    x = gdn_inputs(LENS, *HEADS, *DIMS, device=device)
    steps = torch.full((3, STEPS, HEADS[1], *DIMS), 7.0, device=device)  # 7: never written
    out = run_rule(op, x, step_state=steps, step_indices=_step_rows().to(device))
    return x, out, steps.cpu()


def test_recurrent_step_states_are_the_prefix_states():
    _, _, steps = _rule_with_steps(torch_ref.fused_recurrent_gated_delta_rule)
    for seq, row in ((0, 2), (2, 0)):
        start = sum(LENS[:seq])
        for t in range(STEPS):
            if t >= LENS[seq]:
                assert (steps[row, t] == 7).all()  # past the sequence's tokens: untouched
                continue
            cut = gdn_inputs(LENS, *HEADS, *DIMS)  # the same inputs, only this sequence's first t + 1 tokens
            bounds = [start] * (seq + 1) + [start + t + 1] * (len(LENS) - seq)
            cut = cut._replace(cu_seqlens=torch.tensor(bounds, dtype=torch.int32))
            run_rule(torch_ref.fused_recurrent_gated_delta_rule, cut)
            assert rel_err(steps[row, t], cut.state[cut.state_indices[seq]]) < 1e-5, (seq, t)
    assert (steps[1] == 7).all()  # no sequence's row


def test_conv_step_states_are_the_prefix_states():
    x, weight, bias, conv_state, idx, cu, has_init = conv_inputs(LENS, CHANNELS, WIDTH)
    steps = torch.full((3, STEPS, CHANNELS, WIDTH - 1), 7.0)
    old = conv_state.clone()
    torch_ref.causal_conv1d(x, weight, bias, conv_state, idx, cu, has_init, step_state=steps,
                            step_indices=_step_rows())
    for seq, row in ((0, 2), (2, 0)):
        start, slot = int(cu[seq]), int(idx[seq])
        prev = old[slot] if has_init[seq] else torch.zeros_like(old[slot])
        for t in range(min(STEPS, LENS[seq])):
            window = torch.cat([prev, x[start:start + t + 1].t()], dim=1)[:, -(WIDTH - 1):]
            assert torch.equal(steps[row, t], window), (seq, t)
    assert (steps[1] == 7).all() and (steps[0, 2] == 7).all()  # row 1: no one's; seq 2 has 2 tokens


def test_triton_recurrent_step_states_match_the_reference():
    _, want_out, want = _rule_with_steps(torch_ref.fused_recurrent_gated_delta_rule)
    _, out, got = _rule_with_steps(triton_ops.fused_recurrent_gated_delta_rule)
    assert rel_err(out, want_out) < 1e-4
    written = want != 7
    assert torch.equal(written, got != 7) and rel_err(got[written], want[written]) < 1e-4


def test_triton_conv_step_states_match_the_reference():
    results = []
    for op in (torch_ref.causal_conv1d, triton_ops.causal_conv1d):
        x, weight, bias, conv_state, idx, cu, has_init = conv_inputs(LENS, CHANNELS, WIDTH)
        steps = torch.full((3, STEPS, CHANNELS, WIDTH - 1), 7.0)
        y = op(x, weight, bias, conv_state, idx, cu, has_init, step_state=steps, step_indices=_step_rows())
        results.append((y, conv_state, steps))
    (y0, s0, p0), (y1, s1, p1) = results
    assert rel_err(y1, y0) < 1e-5 and rel_err(s1, s0) < 1e-6 and torch.equal(p1, p0)


@pytest.mark.parametrize("bad", ["alone", "shape"])
def test_bad_step_state_arguments(bad):
    x = gdn_inputs(LENS, *HEADS, *DIMS)
    kw = ({"step_state": torch.zeros(3, STEPS, HEADS[1], *DIMS)} if bad == "alone" else
          {"step_state": torch.zeros(3, STEPS, HEADS[1], DIMS[0] + 1, DIMS[1]), "step_indices": _step_rows()})
    with pytest.raises(ValueError, match="step_state"):
        run_rule(torch_ref.fused_recurrent_gated_delta_rule, x, **kw)
