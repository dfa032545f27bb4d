"""Prefill pacing (SchedulerConfig.prefill_pacing_steps): while sequences decode, a step's prompt
tokens are capped at max(min tokens, ceil(outstanding prompt tokens / K)); with nothing decoding,
or pacing off, prompts get the whole budget. Outputs never change, only which step runs what."""
from __future__ import annotations

import pytest
import torch

from atom_core.config import EngineConfig, SchedulerConfig
from atom_core.engine.kv_cache import KVCacheManager
from atom_core.engine.scheduler import Scheduler
from atom_core.engine.sequence import FinishReason
from tests.engine.test_scheduler import BS, EOS, fake_token_at, make_seq, run_to_end, scheduled, step


def paced(steps: int, min_tokens: int, budget: int = 64, max_num_seqs: int = 16, num_blocks: int = 256) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=False)
    pacing = {"prefill_pacing_steps": steps, "prefill_pacing_min_tokens": min_tokens} if steps else {}  # off: no minimum
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, num_scheduler_steps=1, **pacing)
    return Scheduler(config, kv, 512, {EOS})


def prompt_tokens(out) -> int:
    """Tokens scheduled beyond each entry's one pending token: prompt chunks (decodes schedule 1)."""
    return sum(n for n in out.num_scheduled_tokens if n > 1)


def test_nothing_decoding_gets_the_whole_budget():
    sched = paced(steps=8, min_tokens=4)
    for i in range(4):
        sched.add(make_seq(i, 40))
    out, _ = step(sched)
    assert out.total_tokens == 64  # 40 + 24: no decode yet, so no cap


def test_decoding_caps_prompt_tokens_at_outstanding_over_k():
    sched = paced(steps=8, min_tokens=4)
    sched.add(make_seq(0, 10, max_tokens=50))
    step(sched)  # r0's prompt: it decodes from now on
    for i in range(1, 4):
        sched.add(make_seq(i, 40))
    out, _ = step(sched)
    # outstanding 120 prompt tokens / 8 = 15 a step, r0's decode rides along
    assert scheduled(out) == {"r0": 1, "r1": 15}
    out, _ = step(sched)
    # 105 left (25 of r1 in progress, 80 waiting): ceil(105 / 8) = 14, r1's chunk continues first
    assert scheduled(out) == {"r0": 1, "r1": 14}


def test_the_minimum_cap_holds_when_little_is_outstanding():
    sched = paced(steps=64, min_tokens=12)
    sched.add(make_seq(0, 10, max_tokens=50))
    step(sched)
    sched.add(make_seq(1, 30))
    out, _ = step(sched)
    assert scheduled(out) == {"r0": 1, "r1": 12}  # ceil(30 / 64) = 1 < 12


def test_off_admits_the_whole_budget_beside_decodes():
    sched = paced(steps=0, min_tokens=4)
    sched.add(make_seq(0, 10, max_tokens=50))
    step(sched)
    for i in range(1, 4):
        sched.add(make_seq(i, 40))
    out, _ = step(sched)
    assert scheduled(out) == {"r0": 1, "r1": 40, "r2": 23}


def test_outputs_are_unchanged_and_every_step_respects_the_cap():
    lengths = [37, 5, 60, 18, 44, 9, 71, 26]
    runs = {}
    for k in (0, 4):
        sched = paced(steps=k, min_tokens=6, budget=48)
        seqs = [make_seq(i, n, max_tokens=12) for i, n in enumerate(lengths)]
        for s in seqs:
            sched.add(s)
        history = run_to_end(sched)
        runs[k] = history
        assert all(s.finish_reason == FinishReason.LENGTH for s in seqs)
        assert all(s.output_token_ids == [fake_token_at(s, j) for j in range(12)] for s in seqs)
    capped = [(out, prompt_tokens(out)) for out, _ in runs[4]]
    decodes = [sum(1 for n in out.num_scheduled_tokens if n == 1) for out, _ in runs[4]]
    assert any(p and d for (_, p), d in zip(capped, decodes))  # prompt chunks shared steps with decodes
    assert max(p for (_, p), d in zip(capped, decodes) if d) < max(p for _, p in capped)  # and were capped there


def _closed_loop(steps: int, clients: int = 8, requests: int = 32, prompt: int = 32, output: int = 16):
    """A closed-loop client: each finished request is replaced by a new one at once. Returns the
    number of decode-only steps (decodes with no prompt chunk to ride along) and of all steps."""
    sched = paced(steps=steps, min_tokens=8, budget=2 * prompt, max_num_seqs=clients, num_blocks=1024)  # a wave takes 4 steps
    nxt = 0
    for _ in range(clients):
        sched.add(make_seq(nxt, prompt, max_tokens=output))
        nxt += 1
    decode_only = total = 0
    while sched.has_unfinished():
        out, finished = step(sched)
        total += 1
        decode_only += out.is_decode_only
        for _ in finished:
            if nxt < requests:
                sched.add(make_seq(nxt, prompt, max_tokens=output))
                nxt += 1
        assert total < 2000
    return decode_only, total


def test_pacing_lets_decodes_ride_along_prompt_chunks():
    """The wave problem: a burst admitted in one full-budget step leaves the next steps decode-
    only and the streams finish together; paced, prompt chunks spread over the decode steps."""
    off_decode_only, _ = _closed_loop(steps=0)
    on_decode_only, _ = _closed_loop(steps=8)
    assert on_decode_only < off_decode_only / 2


@pytest.mark.parametrize("kwargs,match", [
    ({"prefill_pacing_steps": -1}, "prefill_pacing_steps"),
    ({"prefill_pacing_min_tokens": 0}, "prefill_pacing_min_tokens"),
    ({"prefill_pacing_steps": 4, "enable_chunked_prefill": False}, "needs chunked prefill"),
    ({"prefill_pacing_min_tokens": 256}, "applies only with prefill_pacing_steps"),  # not accepted and ignored
])
def test_bad_pacing_options_fail_with_the_flag_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_kwargs("/m", **kwargs)


def late_arrivals_equal_hf(tiny_llama, lengths, seed: int, **engine_kwargs):
    """Through the real engine (a tiny random Llama on the CPU): the first prompt decodes for two
    steps before the others arrive; asserts greedy tokens are HF's. Returns the request ids and the
    first step that scheduled one of the late prompts."""
    import json

    from transformers import AutoModelForCausalLM

    from atom_core import LLMEngine, SamplingParams
    from tests.models.harness import hf_greedy

    vocab = json.loads((tiny_llama / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
    want = hf_greedy(AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval(), prompts, 12)
    engine = LLMEngine(str(tiny_llama), device="cpu", dtype="float32", num_kv_blocks=256, **engine_kwargs)
    sched = engine.core.scheduler
    steps = []
    schedule = sched.schedule
    sched.schedule = lambda: steps.append(schedule()) or steps[-1]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ids = engine.add_request(prompts[0], params)  # decoding before the others arrive
    states = {}
    for _ in range(2):
        states.update((st.request_id, st) for st in engine.step())
    ids += engine.add_request(prompts[1:], params)
    while not engine.is_finished():
        states.update((st.request_id, st) for st in engine.step())
    assert [states[rid].token_ids for rid in ids] == want
    return ids, next(out for out in steps if any(r.req_id in ids[1:] for r in out.new_requests))


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_paced_engine_equals_hf_greedy(tiny_llama, async_scheduling):
    """Prompts arriving while another decodes are paced into small chunks that share steps with the
    decodes; greedy tokens are HF's."""
    ids, arrival = late_arrivals_equal_hf(tiny_llama, (5, 40, 90, 33, 120, 7), 3, max_num_batched_tokens=64,
                                          prefill_pacing_steps=8, prefill_pacing_min_tokens=8,
                                          async_scheduling=async_scheduling)
    # "first" decodes; the 290 prompt tokens that arrived are paced at ceil(290 / 8) a step, not 63
    assert scheduled(arrival)[ids[0]] == 1 and prompt_tokens(arrival) == 37
