"""The prefill hold (SchedulerConfig.prefill_hold_fraction F): while sequences decode, prompts wait until
at least F of the live requests are starting (waiting, or part-way through their prompt), until no request
has joined the queue for HOLD_QUIET_STEPS steps, or until the oldest has waited prefill_hold_max_steps
schedule calls; then a wave admits prompts with the whole budget until none is starting. With nothing
decoding, prompts get the whole budget. Outputs never change, only which step runs what."""
from __future__ import annotations

import pytest

from atom_core.config import EngineConfig, SchedulerConfig
from atom_core.engine.kv_cache import KVCacheManager
from atom_core.engine.scheduler import HOLD_QUIET_STEPS, Scheduler
from atom_core.engine.sequence import FinishReason, SequenceStatus
from tests.engine.test_mixed_step_cap import decoding, waiting
from tests.engine.test_prefill_pacing import late_arrivals_equal_hf, prompt_tokens
from tests.engine.test_scheduler import BS, EOS, fake_token_at, make_seq, scheduled, step


def held(fraction: float, max_steps: int = 16, budget: int = 256, max_num_seqs: int = 64,
         num_blocks: int = 4096) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=False)
    hold = {"prefill_hold_fraction": fraction, "prefill_hold_max_steps": max_steps} if fraction else {}
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, num_scheduler_steps=1, **hold)
    return Scheduler(config, kv, 4096, {EOS})


def test_nothing_decoding_gets_the_whole_budget():
    sched = held(0.5)
    waiting(sched, range(4), prompt=100)
    out, _ = step(sched)
    assert out.total_tokens == 256  # no decode yet: nothing to hold for


def test_a_lone_prompt_waits_only_until_the_queue_is_quiet():
    sched = held(0.4)
    decoding(sched, 10)
    sched.add(make_seq(10, 50))
    for _ in range(HOLD_QUIET_STEPS):
        out, _ = step(sched)
        # 1 of 11 live requests starting < 0.4, and it has just joined: a decode-only step
        assert prompt_tokens(out) == 0 and out.is_decode_only and len(out) == 10
    assert sched.requests["r10"].status is SequenceStatus.WAITING
    out, _ = step(sched)  # nobody joined since: no wave is forming, so it starts
    assert scheduled(out)["r10"] == 50


def test_a_growing_queue_is_held_until_the_fraction_starts_a_wave():
    sched = held(0.4)
    decoding(sched, 10)
    for i in range(10, 17):  # one joins every step: 7 of 17 live requests reach 0.4
        sched.add(make_seq(i, 30))
        out, _ = step(sched)
        assert bool(prompt_tokens(out)) == (i == 16)
    assert prompt_tokens(out) == 7 * 30 and not sched.waiting


def test_enough_starting_requests_start_a_wave_that_runs_until_none_is_starting():
    sched = held(0.4)
    decoding(sched, 6)
    waiting(sched, range(6, 9), prompt=200)
    out, _ = step(sched)
    assert prompt_tokens(out) == 0  # 3 of 9 starting < 0.4 x 9
    sched.add(make_seq(9, 200))
    out, _ = step(sched)
    # 4 of 10 starting: the wave admits with the whole budget beside the 6 decodes
    assert prompt_tokens(out) == 250 and sum(1 for n in out.num_scheduled_tokens if n == 1) == 6
    chunks = []
    while True:
        out, _ = step(sched)
        if not prompt_tokens(out):
            break
        chunks.append(prompt_tokens(out))
    # 1 or 2 of 10 starting is below the fraction, yet the wave goes on until every prompt is in
    assert sum(chunks) == 4 * 200 - 250 and all(c > 0 for c in chunks)
    assert not sched.waiting
    sched.add(make_seq(10, 50))
    out, _ = step(sched)
    assert prompt_tokens(out) == 0  # the wave ended: the next lone prompt waits again


def test_the_oldest_prompt_waits_at_most_the_hold_steps():
    sched = held(0.9, max_steps=4)
    decoding(sched, 10)
    held_steps = 0
    for i in range(10, 20):  # one joins every step, far from 0.9 of the live requests
        sched.add(make_seq(i, 20))
        if prompt_tokens(step(sched)[0]):
            break
        held_steps += 1
    assert held_steps == 3  # r10 queued after call n, admitted (with those behind it) at call n + 4
    assert not sched.waiting


def test_a_preempted_sequence_queues_anew():
    sched = held(0.5, num_blocks=6)  # 6 blocks of 4 slots: two growing answers run out of them
    for i in range(2):
        sched.add(make_seq(i, 8, max_tokens=40))
    calls = [sched.num_schedule_calls]
    while not sched.num_preemptions:
        step(sched)
        calls.append(sched.num_schedule_calls)
    (victim,) = sched.waiting
    assert victim.queued_step == calls[-1]


def test_outputs_are_unchanged_and_fewer_prompt_steps_stall_the_decodes():
    lengths = [370, 50, 600, 180, 440, 90, 710, 260, 33, 512]
    runs = {}
    for fraction in (0, 0.5):
        sched = held(fraction, budget=1024)
        seqs = [make_seq(i, n, max_tokens=20 + 7 * i) for i, n in enumerate(lengths)]
        arriving = seqs[3:]
        for s in seqs[:3]:
            sched.add(s)
        outs = []
        while sched.has_unfinished() or arriving:
            if arriving and len(outs) >= 2:  # the rest arrive one a step, as a closed loop's streams return
                sched.add(arriving.pop(0))
            outs.append(step(sched)[0])
            assert len(outs) < 500, "scheduler made no progress"
        runs[fraction] = outs
        assert all(s.finish_reason == FinishReason.LENGTH for s in seqs)
        assert all(s.output_token_ids == [fake_token_at(s, j) for j in range(s.sampling_params.max_tokens)]
                   for s in seqs)
        assert sched.kv.num_free_blocks == sched.kv.num_blocks
    stalls = {f: sum(1 for out in outs if prompt_tokens(out) and any(n == 1 for n in out.num_scheduled_tokens))
              for f, outs in runs.items()}
    assert stalls[0.5] < stalls[0]


@pytest.mark.parametrize("kwargs,match", [
    ({"prefill_hold_fraction": -0.5}, "between 0"),
    ({"prefill_hold_fraction": 1.5}, "between 0"),
    ({"prefill_hold_fraction": 0.4, "prefill_hold_max_steps": 0}, "prefill_hold_max_steps"),
    ({"prefill_hold_max_steps": 8}, "applies only with prefill_hold_fraction"),  # not accepted and ignored
    ({"prefill_hold_fraction": 0.4, "mixed_step_tokens_per_seq": 8}, "choose one"),
    ({"prefill_hold_fraction": 0.4, "prefill_pacing_steps": 8}, "choose one"),
])
def test_bad_options_fail_with_the_flag_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_kwargs("/m", **kwargs)


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("fraction", [0.5, 0.9])
def test_held_engine_equals_hf_greedy(tiny_llama, async_scheduling, fraction):
    """Five prompts arrive at once while another decodes: they start a wave at once at F = 0.5 (5 of 6
    live requests), after the quiet steps at F = 0.9; greedy tokens are HF's either way."""
    ids, arrival = late_arrivals_equal_hf(tiny_llama, (5, 40, 90, 33, 120, 7), 7, max_num_batched_tokens=512,
                                          prefill_hold_fraction=fraction, async_scheduling=async_scheduling)
    assert scheduled(arrival)[ids[0]] == 1 and prompt_tokens(arrival) == 40 + 90 + 33 + 120 + 7
