"""Multi-step decode windows (num_scheduler_steps > 1): same tokens as single steps, fewer host rounds.

Scheduler-level tests drive the real Scheduler and KV manager with fake tokens; engine-level
tests run the tiny models on the CPU and compare every token against num_scheduler_steps=1.
"""
from __future__ import annotations

import random

import pytest

from atom_core.config import SchedulerConfig
from atom_core.engine.kv_cache import KVCacheManager
from atom_core.engine.llm_engine import LLMEngine
from atom_core.engine.scheduler import Scheduler
from atom_core.engine.sequence import FinishReason, Sequence
from atom_core.sampling_params import SamplingParams
from atom_core.scheduler_output import PLACEHOLDER, ModelRunnerOutput

BS = 4
EOS = 0


def make_sched(num_blocks=64, steps=4, max_num_seqs=8):
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, num_scheduler_steps=steps)
    return Scheduler(config, KVCacheManager(num_blocks, BS, enable_prefix_caching=True), 256, {EOS})


def step_counts(out) -> list[int] | None:
    """Tokens each request computes in a window (None: not a window)."""
    return [1 + len(extra) for extra in out.extra_tokens] if out.is_window else None


def add(sched, i, prompt_len=6, **params):
    params.setdefault("ignore_eos", True)
    seq = Sequence(f"r{i}", [10 + i + t for t in range(prompt_len)], SamplingParams(**params))
    sched.add(seq)
    return seq


def prefill(sched):
    batch = sched.schedule()
    assert step_counts(batch) is None  # a prefill is never a window
    sched.update_from_output(batch, ModelRunnerOutput(batch.req_ids, [[100 + i] for i in range(len(batch))]))


class TestWindowPlanning:
    def test_counts_stop_at_each_token_limit_and_blocks_come_first(self):
        sched = make_sched(steps=4)
        short, long = add(sched, 1, max_tokens=3), add(sched, 2, max_tokens=50)
        prefill(sched)
        batch = sched.schedule()
        # short has 1 of 3 tokens: 2 steps left; long keeps all 4.
        assert batch.num_steps == 4 and step_counts(batch) == [2, 4]
        assert batch.extra_tokens == [[PLACEHOLDER], [PLACEHOLDER] * 3]
        for seq, count in zip((short, long), step_counts(batch)):
            assert len(seq.block_table) * BS >= seq.num_computed_tokens + count
        sched.advance(batch)
        assert long.num_placeholders == 4 and short.num_placeholders == 2
        assert long.num_computed_tokens == long.num_tokens - 1
        finished = sched.resolve(batch, ModelRunnerOutput(batch.req_ids, [[7, 8], [9, 10, 11, 12]]))
        assert finished == [short] and short.finish_reason is FinishReason.LENGTH
        assert short.output_token_ids == [100, 7, 8] and long.output_token_ids == [101, 9, 10, 11, 12]

    def test_a_stop_inside_the_window_cuts_the_tokens(self):
        sched = make_sched(steps=4)
        seq = add(sched, 1, max_tokens=20, ignore_eos=False)
        prefill(sched)
        for tokens in ([1], [2, 3]):  # the window grows with the answer (next test)
            batch = sched.schedule()
            sched.update_from_output(batch, ModelRunnerOutput(batch.req_ids, [tokens]))
        batch = sched.schedule()
        assert step_counts(batch) == [4]
        sampled = [[5, EOS, 6, 7]]
        sched.advance(batch)
        assert sched.resolve(batch, ModelRunnerOutput(batch.req_ids, sampled)) == [seq]
        assert sampled == [[5, EOS]] and seq.output_token_ids == [100, 1, 2, 3, 5, EOS] and seq.num_placeholders == 0
        assert seq.finish_reason is FinishReason.STOP and seq.stop_token_id == EOS
        assert not sched.has_unfinished() and sched.kv.num_free_blocks == sched.kv.num_blocks

    @pytest.mark.parametrize("params", [{"ignore_eos": False}, {"stop_token_ids": [7]}])
    def test_windows_grow_with_the_answer_while_a_stop_may_end_it(self, params):
        """An answer that may stop at a stop token runs windows of at most the tokens it has (1, 2, 4,
        then the full 8): a stop ends its window and the one launched after it early, so a short answer
        must not pay two full windows. An answer only max_tokens ends gets the full window at once."""
        sched = make_sched(steps=8)
        add(sched, 1, max_tokens=100, **params)
        prefill(sched)
        lengths = []
        for _ in range(5):
            batch = sched.schedule()
            lengths.append(batch.num_steps)
            sched.update_from_output(batch, ModelRunnerOutput(batch.req_ids, [[3] * batch.num_steps]))
        assert lengths == [1, 2, 4, 8, 8]

    def test_an_answer_that_cannot_stop_sets_the_window_for_one_that_can(self):
        sched = make_sched(steps=8)
        add(sched, 1, max_tokens=100)  # ignore_eos, no stop ids: only max_tokens ends it
        add(sched, 2, max_tokens=100, ignore_eos=False)
        prefill(sched)
        assert step_counts(sched.schedule()) == [8, 8]

    def test_the_window_grows_with_the_longest_answer_in_it(self):
        sched = make_sched(steps=8)
        old = add(sched, 1, max_tokens=100, ignore_eos=False)
        prefill(sched)
        for _ in range(3):  # windows of 1, 2, 4: old has 8 tokens
            batch = sched.schedule()
            sched.update_from_output(batch, ModelRunnerOutput(batch.req_ids, [[3] * batch.num_steps]))
        assert old.num_output_tokens == 8
        new = add(sched, 2, max_tokens=100, ignore_eos=False)
        prefill(sched)  # old decodes one token beside new's prompt
        assert step_counts(sched.schedule()) == [8, 8] and new.num_output_tokens == 1

    @pytest.mark.parametrize("params", [
        {"stop": ["x"]}, {"logprobs": 0}, {"presence_penalty": 0.5}, {"repetition_penalty": 1.2}, {"min_tokens": 5},
    ])
    def test_requests_that_need_every_token_on_the_host_get_single_steps(self, params):
        sched = make_sched(steps=4)
        add(sched, 1, max_tokens=20)
        add(sched, 2, max_tokens=20, **params)
        prefill(sched)
        assert step_counts(sched.schedule()) is None

    def test_no_window_while_a_request_waits(self):
        sched = make_sched(steps=4, max_num_seqs=1)
        add(sched, 1, max_tokens=20)
        prefill(sched)
        add(sched, 2, max_tokens=20)  # cannot be admitted (max_num_seqs=1) but waits
        assert step_counts(sched.schedule()) is None

    def test_a_window_that_does_not_fit_falls_back_to_one_step(self):
        sched = make_sched(num_blocks=3, steps=8)  # 12 slots: 6-token prompt + 8 steps would need 14
        add(sched, 1, max_tokens=50)
        prefill(sched)
        batch = sched.schedule()
        assert step_counts(batch) is None and batch.num_steps == 1 and len(batch) == 1


def _generate(model, steps, prompts, params, **options):
    engine = LLMEngine(str(model), num_scheduler_steps=steps, **options)
    windows = []
    launch = engine.core.executor.launch

    def spy(out, previous=None):
        windows.append(out.num_steps)
        return launch(out, previous)

    engine.core.executor.launch = spy
    outputs = engine.generate(prompts, params)
    _generate.last_engine = engine
    return [(o["token_ids"], o["finish_reason"]) for o in outputs], windows


def _workload(n=10, seed=0, max_prompt=40, max_tokens=30, **params):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 200) for _ in range(rng.randint(3, max_prompt))] for _ in range(n)]
    return prompts, [SamplingParams(max_tokens=rng.randint(1, max_tokens), **params) for _ in range(n)]


@pytest.mark.parametrize("steps", [3, 8])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_greedy_windows_equal_single_steps(tiny_qwen3, steps, async_scheduling):
    prompts, params = _workload(temperature=0, ignore_eos=True)
    want, _ = _generate(tiny_qwen3, 1, prompts, params, async_scheduling=async_scheduling)
    got, windows = _generate(tiny_qwen3, steps, prompts, params, async_scheduling=async_scheduling)
    assert got == want
    assert max(windows) == steps and len(windows) < sum(len(t) for t, _ in want) / 2


def test_seeded_sampling_is_the_same_in_windows(tiny_llama):
    prompts, params = _workload(temperature=0.9, top_k=50, ignore_eos=True)
    params = [SamplingParams(temperature=p.temperature, top_k=p.top_k, ignore_eos=True, max_tokens=p.max_tokens, seed=i)
              for i, p in enumerate(params)]
    want, _ = _generate(tiny_llama, 1, prompts, params)
    got, windows = _generate(tiny_llama, 5, prompts, params)
    assert got == want and max(windows) == 5


def test_stop_token_inside_a_window(tiny_llama):
    prompts, params = _workload(n=6, temperature=0, ignore_eos=True)
    free, _ = _generate(tiny_llama, 1, prompts, [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * 6)
    stops = [SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[tokens[min(5, len(tokens) - 1)]])
             for tokens, _ in free]
    want, _ = _generate(tiny_llama, 1, prompts, stops)
    got, _ = _generate(tiny_llama, 4, prompts, stops)
    assert got == want
    assert any(reason == "stop" and len(tokens) < 30 for tokens, reason in got)


def test_a_short_answer_runs_few_forwards(tiny_llama):
    """A 3-token answer that stops at a stop token: the prefill, then windows of 1 and 2 tokens, and the
    4-token window launched before the stop was seen; full windows of 8 would have run 1 + 8 + 8."""
    prompt = [[5, 17, 42, 9, 33]]
    (free, _), = _generate(tiny_llama, 1, prompt, [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)])[0]
    stop = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[free[2]])
    want, _ = _generate(tiny_llama, 1, prompt, [stop])
    got, windows = _generate(tiny_llama, 8, prompt, [stop])
    assert got == want and got[0][1] == "stop" and len(got[0][0]) <= 3
    assert sum(windows) <= 1 + 1 + 2 + 4


def test_windows_survive_a_small_cache_with_preemption(tiny_qwen3):
    prompts, params = _workload(n=8, max_prompt=20, max_tokens=20, temperature=0, ignore_eos=True)
    want, _ = _generate(tiny_qwen3, 1, prompts, params)
    small = {"num_kv_blocks": 12, "block_size": 4, "max_model_len": 96}
    got, windows = _generate(tiny_qwen3, 6, prompts, params, **small)
    assert got == want and _generate.last_engine.core.scheduler.num_preemptions > 0


def test_invalid_num_scheduler_steps_is_rejected(tiny_llama):
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        LLMEngine(str(tiny_llama), num_scheduler_steps=0)
