"""The mixed-step cap (SchedulerConfig.mixed_step_tokens_per_seq): while sequences decode, a step
carries at most R tokens per live request (running + waiting), to the nearest multiple of 128, at least the
cap's minimum and at most the budget; decodes first, prompt chunks in the rest (never less than 128).
With nothing decoding, prompts get the whole budget. Outputs never change, only which step runs what."""
from __future__ import annotations

import pytest

from atom_core.config import EngineConfig, SchedulerConfig
from atom_core.engine.kv_cache import KVCacheManager
from atom_core.engine.scheduler import MIXED_STEP_GRANULE, Scheduler
from atom_core.engine.sequence import FinishReason
from tests.engine.test_prefill_pacing import late_arrivals_equal_hf, prompt_tokens
from tests.engine.test_scheduler import BS, EOS, fake_token_at, make_seq, run_to_end, scheduled, step


def capped(per_seq: int, min_tokens: int = 64, budget: int = 2048, max_num_seqs: int = 64,
           num_blocks: int = 4096, speculative: int = 0) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=False)
    cap = {"mixed_step_tokens_per_seq": per_seq, "mixed_step_min_tokens": min_tokens} if per_seq else {}
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, num_scheduler_steps=1, **cap)
    return Scheduler(config, kv, 4096, {EOS}, num_speculative_tokens=speculative)


def decoding(sched: Scheduler, n: int, prompt: int = 8) -> None:
    """n requests that have prefilled and now decode (long max_tokens)."""
    for i in range(n):
        sched.add(make_seq(i, prompt, max_tokens=500))
    step(sched)


def waiting(sched: Scheduler, ids: range, prompt: int = 300) -> None:
    """Requests `ids` queued with `prompt`-token prompts."""
    for i in ids:
        sched.add(make_seq(i, prompt))


def test_nothing_decoding_gets_the_whole_budget():
    sched = capped(per_seq=8)
    waiting(sched, range(4), prompt=600)
    out, _ = step(sched)
    assert out.total_tokens == 2048  # no decode yet: no cap


def test_the_cap_is_r_tokens_per_live_request_on_the_granule():
    sched = capped(per_seq=7)
    decoding(sched, 20)
    waiting(sched, range(20, 40))
    out, _ = step(sched)
    # 40 live x 7 = 280 -> 256, the nearest granule: 20 decodes + 236 prompt tokens
    assert out.total_tokens == 256 and prompt_tokens(out) == 236
    assert sum(1 for n in out.num_scheduled_tokens if n == 1) == 20


def test_the_cap_grows_with_the_load():
    totals = {}
    for live_waiting in (20, 140):
        sched = capped(per_seq=8)
        decoding(sched, 20)
        waiting(sched, range(20, 20 + live_waiting))
        out, _ = step(sched)
        totals[live_waiting] = out.total_tokens
    assert totals == {20: 384, 140: 1280}  # 40 x 8 = 320 -> 384, the nearest granule; 160 x 8


def test_the_minimum_and_the_budget_bound_the_cap():
    sched = capped(per_seq=4, min_tokens=192)
    decoding(sched, 2)
    sched.add(make_seq(2, 900))
    out, _ = step(sched)
    assert out.total_tokens == 192  # 3 x 4 = 12 < the minimum
    sched = capped(per_seq=16, budget=512)
    decoding(sched, 10)
    waiting(sched, range(10, 50))
    out, _ = step(sched)
    assert out.total_tokens == 512  # 50 x 16 = 800 > the budget


def test_prompts_always_get_a_granule_beside_many_decodes():
    sched = capped(per_seq=1, min_tokens=64, max_num_seqs=256)
    decoding(sched, 100)
    sched.add(make_seq(100, 300))
    out, _ = step(sched)
    # 101 live x 1 -> 64 < 100 decodes: the prompt still gets a granule beside them
    assert prompt_tokens(out) == MIXED_STEP_GRANULE


def test_drafts_count_against_the_cap():
    sched = capped(per_seq=16, speculative=3)
    decoding(sched, 8)
    waiting(sched, range(8, 16))
    out, _ = step(sched)
    # 16 live x 16 = 256; 8 decodes reserve 1 + 3 tokens each: 224 prompt tokens
    assert prompt_tokens(out) == 224


def test_off_admits_the_whole_budget_beside_decodes():
    sched = capped(per_seq=0, budget=1024)
    decoding(sched, 4)
    waiting(sched, range(4, 8))
    out, _ = step(sched)
    assert out.total_tokens == 1024


def test_outputs_are_unchanged_and_every_mixed_step_respects_the_cap():
    lengths = [370, 50, 600, 180, 440, 90, 710, 260, 33, 512]
    runs = {}
    for r in (0, 8):
        sched = capped(per_seq=r, budget=1024)
        seqs = [make_seq(i, n, max_tokens=20) for i, n in enumerate(lengths)]
        for s in seqs:
            sched.add(s)
        runs[r] = run_to_end(sched)
        assert all(s.finish_reason == FinishReason.LENGTH for s in seqs)
        assert all(s.output_token_ids == [fake_token_at(s, j) for j in range(20)] for s in seqs)
    mixed = [out for out, _ in runs[8] if prompt_tokens(out) and any(n == 1 for n in out.num_scheduled_tokens)]
    # 10 live x 8 = 80 -> the 64 minimum, less the decodes: prompts get the one-granule floor
    assert mixed and all(prompt_tokens(out) <= MIXED_STEP_GRANULE for out in mixed)
    assert max(prompt_tokens(out) for out, _ in runs[0] if any(n == 1 for n in out.num_scheduled_tokens)) > 400


@pytest.mark.parametrize("kwargs,match", [
    ({"mixed_step_tokens_per_seq": -1}, "mixed_step_tokens_per_seq"),
    ({"mixed_step_tokens_per_seq": 4, "mixed_step_min_tokens": 0}, "mixed_step_min_tokens"),
    ({"mixed_step_tokens_per_seq": 4, "enable_chunked_prefill": False}, "needs chunked prefill"),
    ({"mixed_step_tokens_per_seq": 4, "prefill_pacing_steps": 8}, "choose one"),
    ({"mixed_step_min_tokens": 128}, "applies only with mixed_step_tokens_per_seq"),  # not accepted and ignored
])
def test_bad_options_fail_with_the_flag_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_kwargs("/m", **kwargs)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_capped_engine_equals_hf_greedy(tiny_llama, async_scheduling):
    """Prompts arriving while another decodes share capped steps with it, a chunk at a time; greedy
    tokens are HF's."""
    ids, arrival = late_arrivals_equal_hf(tiny_llama, (5, 140, 90, 33, 200, 7), 5, max_num_batched_tokens=512,
                                          mixed_step_tokens_per_seq=8, mixed_step_min_tokens=256,
                                          async_scheduling=async_scheduling)
    # 6 live x 8 = 48 -> the 256 minimum: "first" decodes, 255 prompt tokens ride along (not 470)
    assert scheduled(arrival)[ids[0]] == 1 and arrival.total_tokens == 256
