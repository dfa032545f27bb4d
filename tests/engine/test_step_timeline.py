"""StepTimeline: which entries are prompt work and which decode, step wall times from an injected
clock, the summary's exact numbers, and the EngineCore hook on a tiny CPU model."""
import pytest

from atom_core.engine.step_timeline import StepTimeline
from atom_core.sampling_params import SamplingParams
from atom_core.scheduler_output import PLACEHOLDER, NewRequest, SchedulerOutput


def step(*entries, new=(), finished=(), decode_only=False) -> SchedulerOutput:
    """entries: (request id, scheduled tokens, computed before, extra tokens); new: (id, prompt length)."""
    out = SchedulerOutput()
    for rid, n, computed, extra in entries:
        out.add(rid, n, computed)
        out.extra_tokens[-1] = list(extra)
    out.new_requests = [NewRequest(rid, [7] * length, [], SamplingParams(), 0) for rid, length in new]
    out.finished_req_ids = list(finished)
    out.is_decode_only = decode_only
    return out


def timeline(*times: float, running: dict | None = None) -> StepTimeline:
    """A started timeline whose clock reads times[0] at start, then times[1:] at each record."""
    t = StepTimeline(clock=iter(times).__next__)
    t.start(running)
    return t


def only_step(out: SchedulerOutput, running: dict | None = None) -> tuple[str, dict]:
    """The kind one step is counted as, and its counts."""
    t = timeline(0.0, 1.0, running=running)
    t.record(out)
    summary = t.summary()
    kind = "with_prompt" if summary["with_prompt"]["steps"] else "decode_only"
    assert summary[kind]["steps"] == 1
    return kind, {k: summary[kind][k] for k in ("prompt_tokens", "decodes", "decode_tokens", "forwards")}


class TestRecord:
    def test_a_whole_prompt_is_prompt_work(self):
        out = step(("a", 20, 0, ()), ("b", 12, 0, ()), new=[("a", 20), ("b", 12)])
        assert only_step(out) == ("with_prompt", dict(prompt_tokens=32, decodes=0, decode_tokens=0, forwards=1))

    def test_a_decode_only_step_is_all_decodes(self):
        out = step(("a", 1, 20, ()), ("b", 1, 13, ()), decode_only=True)
        assert only_step(out, {"a": 20, "b": 12}) == (
            "decode_only", dict(prompt_tokens=0, decodes=2, decode_tokens=2, forwards=1))

    def test_a_mixed_step_carries_prompt_tokens_and_decodes(self):
        out = step(("a", 1, 20, ()), ("c", 30, 0, ()), new=[("c", 30)])
        assert only_step(out, {"a": 20}) == (
            "with_prompt", dict(prompt_tokens=30, decodes=1, decode_tokens=1, forwards=1))

    def test_a_chunked_prompt_is_prompt_work_to_its_last_token(self):
        t = timeline(0.0, 1.0, 2.0, 3.0)
        t.record(step(("a", 16, 0, ()), new=[("a", 17)]))
        t.record(step(("a", 1, 16, ()), ("b", 1, 40, ())))  # the prompt's 17th token: not a decode
        t.record(step(("a", 1, 17, ()), ("b", 1, 41, ()), decode_only=True))
        summary = t.summary()
        assert summary["with_prompt"]["steps"] == 2 and summary["with_prompt"]["prompt_tokens"] == 17
        assert summary["with_prompt"]["decodes"] == 1  # b, running before start(): past its prompt
        assert summary["decode_only"]["steps"] == 1 and summary["decode_only"]["decodes"] == 2

    def test_a_prefix_hit_leaving_one_token_is_prompt_work(self):
        out = step(("a", 1, 31, ()), new=[("a", 32)])
        assert only_step(out)[1]["prompt_tokens"] == 1

    def test_running_requests_given_at_start_keep_their_prompt_length(self):
        assert only_step(step(("a", 1, 19, ())), {"a": 20})[1]["prompt_tokens"] == 1
        assert only_step(step(("a", 1, 20, ())), {"a": 20})[1]["decodes"] == 1

    def test_draft_tokens_count_with_their_decode_in_one_forward(self):
        out = step(("a", 1, 20, (5, 6, 7)), ("b", 1, 10, ()))  # drafts: the scheduler says not decode-only
        assert only_step(out, {"a": 20, "b": 10}) == (
            "decode_only", dict(prompt_tokens=0, decodes=2, decode_tokens=5, forwards=1))

    def test_window_tokens_count_with_their_decode_and_as_forwards(self):
        out = step(("a", 1, 20, [PLACEHOLDER] * 3), ("b", 1, 10, [PLACEHOLDER] * 1), decode_only=True)
        assert only_step(out) == ("decode_only", dict(prompt_tokens=0, decodes=2, decode_tokens=6, forwards=4))

    def test_finished_requests_are_forgotten(self):
        t = timeline(0.0, 1.0, 2.0)
        t.record(step(("a", 5, 0, ()), ("b", 5, 0, ()), new=[("a", 5), ("b", 5)]))
        t.record(step(("b", 1, 5, ()), finished=["a"], decode_only=True))
        assert t._prompt_lens == {"b": 5}  # memory bounded by the live requests


class TestSummary:
    def test_step_times_are_the_intervals_between_resolves(self):
        t = timeline(100.0, 100.5, 100.75, 101.0, 103.0)
        t.record(step(("a", 8, 0, ()), ("b", 8, 0, ()), new=[("a", 8), ("b", 8)]))  # 0.5 s
        t.record(step(("a", 1, 8, ()), ("b", 1, 8, ()), decode_only=True))  # 0.25 s
        t.record(step(("a", 1, 9, ()), ("c", 4, 0, ()), new=[("c", 4)]))  # 0.25 s
        t.record(step(("a", 1, 10, [PLACEHOLDER]), ("b", 1, 9, [PLACEHOLDER]), ("c", 1, 4, [PLACEHOLDER]),
                      decode_only=True))  # 2 s
        summary = t.summary()
        assert summary["with_prompt"] == dict(steps=2, forwards=2, seconds=0.75, prompt_tokens=20, decodes=1,
                                              decode_tokens=1, mean_decodes_per_step=0.5, mean_ms_per_step=375.0)
        assert summary["decode_only"] == dict(steps=2, forwards=3, seconds=2.25, prompt_tokens=0, decodes=5,
                                              decode_tokens=8, mean_decodes_per_step=2.5, mean_ms_per_step=1125.0)
        assert summary["total"] == dict(steps=4, forwards=5, seconds=3.0, prompt_tokens=20, decodes=6,
                                        decode_tokens=9, mean_decodes_per_step=1.5, mean_ms_per_step=750.0)

    def test_decode_only_steps_by_batch_size(self):
        def decodes(n: int) -> SchedulerOutput:
            return step(*((f"r{i}", 1, 10, ()) for i in range(n)), decode_only=True)

        t = timeline(0.0, 1.0, 1.5, 3.5, 3.75)
        for n in (8, 9, 300, 32):
            t.record(decodes(n))
        rows = {row["batch"]: row for row in t.summary()["decode_only_by_batch"]}
        assert list(rows) == ["1-8", "9-32", "33-64", "65-128", "129-256", ">256"]
        assert {b: (r["steps"], r["seconds"], r["decodes"]) for b, r in rows.items()} == {
            "1-8": (1, 1.0, 8), "9-32": (2, 0.75, 41), "33-64": (0, 0.0, 0), "65-128": (0, 0.0, 0),
            "129-256": (0, 0.0, 0), ">256": (1, 2.0, 300)}
        assert rows["9-32"]["mean_ms_per_step"] == 375.0 and rows["9-32"]["mean_decodes_per_step"] == 20.5

    def test_no_steps_is_all_zeros(self):
        summary = timeline(5.0).summary()
        assert summary["total"] == dict(steps=0, forwards=0, seconds=0.0, prompt_tokens=0, decodes=0,
                                        decode_tokens=0, mean_decodes_per_step=0.0, mean_ms_per_step=0.0)
        assert all(row["steps"] == 0 for row in summary["decode_only_by_batch"])


class TestEngineCoreHook:
    @pytest.mark.parametrize("async_scheduling", [True, False])
    def test_records_each_resolved_step_between_start_and_stop(self, tiny_llama, async_scheduling):
        from atom_core import LLMEngine

        engine = LLMEngine(str(tiny_llama), num_kv_blocks=64, num_scheduler_steps=1, async_scheduling=async_scheduling)
        core = engine.core
        assert core.step_timeline is None  # off unless started
        core.start_step_timeline()
        engine.generate([[3] * 10, [4] * 10], SamplingParams(max_tokens=5, ignore_eos=True))
        summary = core.stop_step_timeline()
        # one step prefills both prompts (and samples their first tokens), four decode both
        assert summary["with_prompt"]["steps"] == 1 and summary["with_prompt"]["prompt_tokens"] == 20
        assert summary["decode_only"]["steps"] == 4 and summary["decode_only"]["decodes"] == 8
        assert summary["decode_only_by_batch"][0]["steps"] == 4
        assert core.step_timeline is None
        with pytest.raises(ValueError, match="no step timeline is running"):
            core.stop_step_timeline()

    def test_requests_running_at_start_keep_their_prompt_length(self, tiny_llama):
        from atom_core import LLMEngine

        engine = LLMEngine(str(tiny_llama), num_kv_blocks=64, max_num_batched_tokens=16, num_scheduler_steps=1,
                           async_scheduling=False)
        engine.add_request([[5] * 17], SamplingParams(max_tokens=3, ignore_eos=True))
        engine.step()  # 16 of its 17 prompt tokens, before the timeline starts
        engine.core.start_step_timeline()
        while not engine.is_finished():
            engine.step()
        summary = engine.core.stop_step_timeline()
        # the prompt's 17th token is one scheduled token, yet prompt work; then two decodes
        assert summary["with_prompt"]["prompt_tokens"] == 1 and summary["with_prompt"]["decodes"] == 0
        assert summary["decode_only"]["steps"] == 2 and summary["decode_only"]["decodes"] == 2
