"""Scheduler: token budget, chunked prefill, max_num_seqs, preemption, FCFS, abort.

The real Scheduler and KVCacheManager drive plain Sequences; "the model" is a fake that
samples a deterministic token per (request, output index) for every sequence that reaches its
last known token, exactly as the runner reports it to `update_from_output`.
"""
from __future__ import annotations

import pytest

from atom_core.engine.kv_cache import KVCacheManager
from atom_core.config import SchedulerConfig
from atom_core.engine.scheduler import Scheduler
from atom_core.engine.sequence import PLACEHOLDER, FinishReason, Sequence, SequenceStatus
from atom_core.sampling_params import SamplingParams
from atom_core.scheduler_output import ModelRunnerOutput, SchedulerOutput

EOS = 0
BS = 4


def fake_token_at(seq: Sequence, k: int) -> int:
    """The token request `seq` samples as its k-th output: depends only on the two."""
    return 1000 + 100 * int(seq.request_id.strip("r")) + k


def fake_token(seq: Sequence) -> int:
    return fake_token_at(seq, seq.num_output_tokens)


def make_sched(num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 64, max_model_len: int = 256,
               prefix_caching: bool = False) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=prefix_caching)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, num_scheduler_steps=1)
    return Scheduler(config, kv, max_model_len, {EOS})


def make_seq(i: int, prompt_len: int, max_tokens: int = 4, **params) -> Sequence:
    tokens = [10 + (7 * i + t) % 500 for t in range(prompt_len)]
    return Sequence(f"r{i}", tokens, SamplingParams(max_tokens=max_tokens, **params))


def samples(sched: Scheduler, out: SchedulerOutput, i: int) -> bool:
    """Whether entry i reaches its last known token this step (asked before `advance`)."""
    seq = sched.requests[out.req_ids[i]]
    return seq.num_computed_tokens + out.num_scheduled_tokens[i] == seq.num_tokens


def result(out: SchedulerOutput, tokens: list[int | None]) -> ModelRunnerOutput:
    """What the runner reports: one token per sampling entry, nothing for the others."""
    return ModelRunnerOutput(out.req_ids, [[t] if t is not None else [] for t in tokens])


def step(sched: Scheduler, tokens: dict[str, int] | None = None) -> tuple[SchedulerOutput, list[Sequence]]:
    """One engine step with the fake model; `tokens` overrides sampled ids per request id."""
    out = sched.schedule()
    sampled = []
    for i, rid in enumerate(out.req_ids):
        if samples(sched, out, i):
            sampled.append((tokens or {}).get(rid, fake_token(sched.requests[rid])))
        else:
            sampled.append(None)
    return out, sched.update_from_output(out, result(out, sampled))


def run_to_end(sched: Scheduler, max_steps: int = 500) -> list[tuple[SchedulerOutput, list[Sequence]]]:
    history = []
    while sched.has_unfinished():
        history.append(step(sched))
        assert len(history) < max_steps, "scheduler made no progress"
    assert sched.kv.num_free_blocks == sched.kv.num_blocks, "blocks leaked"
    return history


def scheduled(out: SchedulerOutput) -> dict[str, int]:
    return dict(zip(out.req_ids, out.num_scheduled_tokens))


class TestTokenBudget:
    def test_every_step_stays_within_the_budget(self):
        sched = make_sched(budget=32)
        seqs = [make_seq(i, n, max_tokens=5) for i, n in enumerate([30, 7, 50, 3, 19, 40])]
        for s in seqs:
            sched.add(s)
        history = run_to_end(sched)
        assert all(0 < b.total_tokens <= 32 for b, _ in history)
        assert history[0][0].total_tokens == 32  # the budget is used, not wasted
        assert all(s.finish_reason == FinishReason.LENGTH and s.num_output_tokens == 5 for s in seqs)
        assert all(s.output_token_ids == [fake_token_at(s, k) for k in range(5)] for s in seqs)

    def test_budget_of_one_token_still_finishes(self):
        sched = make_sched(budget=1)
        seqs = [make_seq(0, 5, max_tokens=3), make_seq(1, 2, max_tokens=3)]
        for s in seqs:
            sched.add(s)
        history = run_to_end(sched)
        assert all(b.total_tokens == 1 for b, _ in history)
        assert all(s.num_output_tokens == 3 for s in seqs)


class TestChunkedPrefill:
    def test_long_prompt_is_split_across_steps_and_samples_once_at_the_end(self):
        sched = make_sched(budget=32)
        seq = make_seq(0, 100, max_tokens=2)
        sched.add(seq)
        chunks = []
        for _ in range(4):
            batch, _ = step(sched)
            assert len(batch) == 1
            chunks.append(batch.num_scheduled_tokens[0])
            if seq.num_computed_tokens < 100:
                assert seq.num_output_tokens == 0, "sampled before the prompt was complete"
        assert chunks == [32, 32, 32, 4]
        assert seq.num_computed_tokens == 100 and seq.num_output_tokens == 1
        run_to_end(sched)
        assert seq.output_token_ids == [1000, 1001]

    def test_prefill_chunk_shares_a_step_with_decodes(self):
        sched = make_sched(budget=16)
        short = make_seq(0, 5, max_tokens=10)
        sched.add(short)
        step(sched)  # short's prefill; it now decodes
        long = make_seq(1, 40, max_tokens=2)
        sched.add(long)
        batch, _ = step(sched)
        assert scheduled(batch) == {"r0": 1, "r1": 15}
        assert short.num_output_tokens == 2 and long.num_output_tokens == 0
        batch, _ = step(sched)
        assert scheduled(batch) == {"r0": 1, "r1": 15}
        assert short.num_output_tokens == 3 and long.num_output_tokens == 0
        batch, _ = step(sched)
        assert scheduled(batch) == {"r0": 1, "r1": 10}  # last chunk: it samples
        assert short.num_output_tokens == 4 and long.num_output_tokens == 1
        batch = sched.schedule()
        assert scheduled(batch) == {"r0": 1, "r1": 1} and batch.is_decode_only
        sched.update_from_output(batch, result(batch, [fake_token(short), fake_token(long)]))
        run_to_end(sched)
        assert short.num_output_tokens == 10 and long.num_output_tokens == 2

    def test_without_chunking_a_prompt_waits_for_a_step_with_room(self):
        kv = KVCacheManager(64, BS, enable_prefix_caching=False)
        config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, enable_chunked_prefill=False,
                                 num_scheduler_steps=1)
        sched = Scheduler(config, kv, 256, {EOS})
        a, b = make_seq(0, 10, max_tokens=3), make_seq(1, 12, max_tokens=2)
        sched.add(a)
        sched.add(b)
        batch, _ = step(sched)
        assert scheduled(batch) == {"r0": 10}  # b's 12 tokens are not split to fill the last 6
        assert b.status == SequenceStatus.WAITING
        batch, _ = step(sched)
        assert scheduled(batch) == {"r0": 1, "r1": 12}
        run_to_end(sched)


class TestMaxNumSeqs:
    def test_running_and_scheduled_sequences_never_exceed_max_num_seqs(self):
        sched = make_sched(max_num_seqs=2, budget=256)
        seqs = [make_seq(i, 6, max_tokens=3) for i in range(5)]
        for s in seqs:
            sched.add(s)
        for batch, _ in run_to_end(sched):
            assert len(batch) <= 2
            assert sched.num_running <= 2
        assert all(s.num_output_tokens == 3 for s in seqs)

    def test_a_slot_freed_by_a_finish_is_refilled_next_step(self):
        sched = make_sched(max_num_seqs=2, budget=256)
        seqs = [make_seq(0, 4, max_tokens=1), make_seq(1, 4, max_tokens=5), make_seq(2, 4, max_tokens=1)]
        for s in seqs:
            sched.add(s)
        batch, finished = step(sched)
        assert scheduled(batch) == {"r0": 4, "r1": 4}
        assert finished == [seqs[0]]
        batch, _ = step(sched)
        assert scheduled(batch) == {"r1": 1, "r2": 4}
        run_to_end(sched)


class TestPreemption:
    def _two_decoders(self):
        # 6 blocks of 4 tokens; two 8-token prompts that decode 12 tokens each need 10 blocks.
        sched = make_sched(num_blocks=6, budget=64)
        old, new = make_seq(0, 8, max_tokens=12), make_seq(1, 8, max_tokens=12)
        sched.add(old)
        sched.add(new)
        return sched, old, new

    def test_preempts_newest_when_blocks_run_out(self):
        sched, old, new = self._two_decoders()
        while sched.num_preemptions == 0:
            batch, _ = step(sched)
        assert new.num_preemptions == 1 and old.num_preemptions == 0
        assert new.status == SequenceStatus.WAITING and new.block_table == []
        assert new.num_computed_tokens == 0
        assert sched.waiting[0] is new
        assert batch.req_ids == ["r0"]  # the step went on without it
        assert len(old.block_table) * BS >= old.num_computed_tokens + 1

    def test_preempted_sequence_resumes_with_unchanged_output(self):
        sched, old, new = self._two_decoders()
        recomputes = []
        while sched.has_unfinished():
            before = new.num_preemptions
            batch, _ = step(sched)
            sizes = scheduled(batch)
            if before and "r1" in sizes and new.num_computed_tokens == sizes["r1"] and sizes["r1"] > 1:
                recomputes.append(sizes["r1"])
        assert sched.num_preemptions >= 1
        assert recomputes, "the preempted sequence never recomputed its tokens"
        assert recomputes[0] > 8  # prompt plus the tokens it had generated before preemption
        assert sched.kv.num_free_blocks == sched.kv.num_blocks
        for seq in (old, new):
            assert seq.finish_reason == FinishReason.LENGTH
            assert seq.output_token_ids == [fake_token_at(seq, k) for k in range(12)]

    def test_preempted_sequence_goes_ahead_of_later_arrivals(self):
        sched, old, new = self._two_decoders()
        while sched.num_preemptions == 0:
            step(sched)
        late = make_seq(2, 4, max_tokens=1)
        sched.add(late)
        assert list(sched.waiting) == [new, late]
        admitted = []
        for batch, _ in run_to_end(sched):
            admitted += [rid for rid in batch.req_ids if rid not in admitted]
        assert admitted.index("r1") < admitted.index("r2")

    def test_newest_preempts_itself_when_it_cannot_grow_and_finishes_later(self):
        sched = make_sched(num_blocks=3, budget=64)
        a, b = make_seq(0, 4, max_tokens=5), make_seq(1, 4, max_tokens=5)
        sched.add(a)
        sched.add(b)
        run_to_end(sched)
        assert a.num_output_tokens == 5 and b.num_output_tokens == 5
        assert sched.num_preemptions >= 1


class TestFcfs:
    def test_requests_are_admitted_and_finish_in_arrival_order(self):
        sched = make_sched(max_num_seqs=1, budget=256)
        seqs = [make_seq(i, 3 + i, max_tokens=2) for i in range(4)]
        for s in seqs:
            sched.add(s)
        admitted, finished = [], []
        while sched.has_unfinished():
            batch, done = step(sched)
            admitted += [rid for rid in batch.req_ids if rid not in admitted]
            finished += [s.request_id for s in done]
        assert admitted == finished == ["r0", "r1", "r2", "r3"]

    def test_a_blocked_head_is_not_overtaken_by_a_smaller_request(self):
        sched = make_sched(num_blocks=4, budget=256)
        hog = make_seq(1, 11, max_tokens=3)  # holds 3 of the 4 blocks
        sched.add(hog)
        step(sched)
        blocked = make_seq(2, 8, max_tokens=1)  # needs 2 blocks, only 1 free
        small = make_seq(3, 2, max_tokens=1)  # would fit
        sched.add(blocked)
        sched.add(small)
        batch, _ = step(sched)
        assert "r3" not in scheduled(batch)
        run_to_end(sched)
        assert blocked.num_output_tokens == 1 and small.num_output_tokens == 1

    def test_duplicate_request_id_is_rejected(self):
        sched = make_sched()
        sched.add(make_seq(0, 3))
        with pytest.raises(ValueError, match="duplicate request id"):
            sched.add(make_seq(0, 3))
        sched.finish_requests(["r0"], FinishReason.ABORT)


class TestFinishRequests:
    def test_abort_of_running_sequence_frees_its_blocks(self):
        sched = make_sched()
        a, b = make_seq(0, 10, max_tokens=8), make_seq(1, 10, max_tokens=8)
        sched.add(a)
        sched.add(b)
        step(sched)
        used_by_a = len(a.block_table)
        free_before = sched.kv.num_free_blocks
        done = sched.finish_requests(["r0"], FinishReason.ABORT)
        assert done == [a]
        assert a.is_finished and a.finish_reason == FinishReason.ABORT
        assert a not in sched.running and a.block_table == []
        assert sched.kv.num_free_blocks == free_before + used_by_a
        run_to_end(sched)
        assert b.num_output_tokens == 8

    def test_abort_of_waiting_sequence_and_unknown_ids(self):
        sched = make_sched(max_num_seqs=1)
        a, b = make_seq(0, 4, max_tokens=3), make_seq(1, 4, max_tokens=3)
        sched.add(a)
        sched.add(b)
        step(sched)
        assert b in sched.waiting
        assert sched.finish_requests(["r1", "nope"], FinishReason.ABORT) == [b]
        assert b not in sched.waiting and "r1" not in sched.requests
        assert sched.finish_requests(["r1"], FinishReason.ABORT) == []  # already gone
        run_to_end(sched)

    def test_sequence_aborted_while_its_step_ran_is_left_alone(self):
        sched = make_sched()
        a = make_seq(0, 6, max_tokens=4)
        sched.add(a)
        batch = sched.schedule()
        sched.finish_requests(["r0"], FinishReason.ABORT)
        assert sched.update_from_output(batch, result(batch, [1234])) == []
        assert a.num_output_tokens == 0 and a.finish_reason == FinishReason.ABORT
        assert sched.kv.num_free_blocks == sched.kv.num_blocks
        assert not sched.has_unfinished()


class TestStopChecks:
    def test_eos_stops_unless_ignored_and_not_before_min_tokens(self):
        sched = make_sched()
        stops = make_seq(0, 3, max_tokens=10)
        ignores = make_seq(1, 3, max_tokens=3, ignore_eos=True)
        early = make_seq(2, 3, max_tokens=10, min_tokens=2)
        for s in (stops, ignores, early):
            sched.add(s)
        step(sched, {"r0": EOS, "r1": EOS, "r2": EOS})
        assert stops.finish_reason == FinishReason.STOP and stops.stop_token_id == EOS
        assert not ignores.is_finished and not early.is_finished
        step(sched, {"r1": EOS, "r2": EOS})
        assert early.finish_reason == FinishReason.STOP and early.num_output_tokens == 2
        step(sched, {"r1": EOS})
        assert not sched.has_unfinished()
        assert ignores.finish_reason == FinishReason.LENGTH and ignores.output_token_ids == [EOS] * 3

    def test_max_model_len_caps_a_request_without_max_tokens(self):
        sched = make_sched(max_model_len=12)
        seq = make_seq(0, 8, max_tokens=None)
        sched.add(seq)
        run_to_end(sched)
        assert seq.finish_reason == FinishReason.LENGTH and seq.num_tokens == 12


class TestAsyncScheduling:
    """EngineCore's async loop: schedule and launch step N+1 (its inputs may be placeholders),
    then resolve step N. Outputs must equal the synchronous loop's, preemption included."""

    @staticmethod
    def run_async(sched: Scheduler) -> list[SchedulerOutput]:
        batches, pending = [], None
        while sched.has_unfinished() or pending is not None:
            batch = sched.schedule()
            launched = None
            if batch:
                # what the device samples, decided at launch from the output index
                tokens = [fake_token(sched.requests[rid]) if samples(sched, batch, i) else None
                          for i, rid in enumerate(batch.req_ids)]
                sched.advance(batch)
                launched = (batch, result(batch, tokens))
                batches.append(batch)
            if pending is not None:
                sched.resolve(*pending)
            pending = launched
            assert len(batches) < 500
        assert sched.kv.num_free_blocks == sched.kv.num_blocks
        return batches

    def test_decodes_are_scheduled_on_placeholder_tokens(self):
        sched = make_sched()
        seq = make_seq(0, 5, max_tokens=4)
        sched.add(seq)
        sched.advance(sched.schedule())  # prefill launched, its sample not back yet
        assert seq.num_placeholders == 1 and seq.token_ids[-1] == PLACEHOLDER
        batch = sched.schedule()
        assert scheduled(batch) == {"r0": 1}  # the next step runs ahead on the placeholder
        sched.finish_requests(["r0"], FinishReason.ABORT)

    @pytest.mark.parametrize("num_blocks", [64, 6], ids=["roomy", "preempting"])
    def test_async_outputs_equal_sync_outputs(self, num_blocks):
        sched = make_sched(num_blocks=num_blocks, budget=16)
        seqs = [make_seq(0, 8, max_tokens=12), make_seq(1, 8, max_tokens=12), make_seq(2, 3, max_tokens=3)]
        for s in seqs:
            sched.add(s)
        self.run_async(sched)
        if num_blocks == 6:
            assert sched.num_preemptions > 0
        for s in seqs:
            assert s.finish_reason == FinishReason.LENGTH and s.num_placeholders == 0
            assert s.output_token_ids == [fake_token_at(s, k) for k in range(s.sampling_params.max_tokens)]

    def test_eos_mid_flight_discards_the_step_already_launched(self):
        sched = make_sched()
        seq = make_seq(0, 4, max_tokens=10)
        sched.add(seq)
        first = sched.schedule()
        sched.advance(first)
        second = sched.schedule()  # launched before the first step's EOS is known
        sched.advance(second)
        assert sched.resolve(first, result(first, [EOS])) == [seq]
        assert sched.resolve(second, result(second, [1234])) == []
        assert seq.output_token_ids[0] == EOS and seq.finish_reason == FinishReason.STOP
        assert sched.kv.num_free_blocks == sched.kv.num_blocks and not sched.has_unfinished()


class TestSchedulerOutput:
    """The step message is plain data: what the worker needs to mirror every request."""

    def test_new_request_carries_its_prompt_and_blocks_then_only_added_blocks(self):
        sched = make_sched(budget=64)
        seq = make_seq(0, 6, max_tokens=8)
        sched.add(seq)
        out, _ = step(sched)
        assert [r.req_id for r in out.new_requests] == ["r0"]
        assert out.new_requests[0].prompt_token_ids == seq.prompt_token_ids
        assert out.new_block_ids == {"r0": (0, seq.block_table[:2])}
        out, _ = step(sched)  # position 6 still fits block 1
        assert out.new_requests == [] and out.new_block_ids == {}
        assert out.num_computed_tokens == [6] and out.is_decode_only
        step(sched)
        out, _ = step(sched)  # position 8 opens block 2
        assert out.new_block_ids == {"r0": (2, [seq.block_table[2]])}

    def test_finished_ids_reach_the_next_step_that_runs(self):
        sched = make_sched()
        a, b = make_seq(0, 3, max_tokens=1), make_seq(1, 3, max_tokens=4)
        sched.add(a)
        sched.add(b)
        out, done = step(sched)
        assert done == [a] and out.finished_req_ids == []
        out, _ = step(sched)
        assert out.finished_req_ids == ["r0"]
        out, _ = step(sched)
        assert out.finished_req_ids == []

    def test_resumed_request_is_sent_again_with_its_outputs(self):
        sched = make_sched(num_blocks=5, budget=64)
        a, b = make_seq(0, 7, max_tokens=12), make_seq(1, 7, max_tokens=12)
        sched.add(a)
        sched.add(b)
        resent = []
        while sched.has_unfinished():
            out, _ = step(sched)
            resent += [r for r in out.new_requests if r.output_token_ids]
        assert sched.num_preemptions > 0 and resent
        assert all(r.output_token_ids == [fake_token_at(b if r.req_id == "r1" else a, k)
                                          for k in range(len(r.output_token_ids))] for r in resent)


class TestKVRollback:
    def test_trim_gives_back_trailing_blocks_and_rewinds_the_sequence(self):
        kv = KVCacheManager(16, BS, enable_prefix_caching=False)
        seq = make_seq(0, 10)
        kv.allocate(seq, 10)
        kv.append_slots(seq, 17)  # room for 7 draft tokens: 5 blocks
        seq.num_computed_tokens = 17
        seq.num_sent_blocks = 5
        kept = seq.block_table[:3]
        assert kv.trim_slots(seq, 11) == 2
        assert seq.block_table == kept and seq.num_computed_tokens == 11 and seq.num_sent_blocks == 3
        assert kv.num_free_blocks == 16 - 3
        assert kv.trim_slots(seq, 12) == 0
        kv.free(seq)
        assert kv.num_free_blocks == 16

    def test_trim_keeps_published_blocks(self):
        kv = KVCacheManager(16, BS, enable_prefix_caching=True)
        seq = make_seq(0, 12)
        kv.allocate(seq, 12)
        seq.num_computed_tokens = 12
        kv.cache_full_blocks(seq)
        assert kv.trim_slots(seq, 2) == 0 and len(seq.block_table) == 3
        kv.free(seq)
        assert kv.num_free_blocks == 16

    def test_worker_table_follows_a_trim(self):
        from atom_core.worker.input_batch import InputBatch

        sched = make_sched(budget=64)
        seq = make_seq(0, 9, max_tokens=20)
        sched.add(seq)
        batch = InputBatch()
        out, _ = step(sched)
        batch.update(out)
        sched.kv.append_slots(seq, 20)  # slots for drafts: the worker learns them with the next step
        out, _ = step(sched)
        batch.update(out)
        assert len(batch.requests["r0"].block_ids) == 5
        sched.kv.trim_slots(seq, 11)  # the drafts were rejected
        sched.kv.append_slots(seq, 14)
        out, _ = step(sched)
        batch.update(out)
        assert out.new_block_ids["r0"][0] == 3
        assert batch.requests["r0"].block_ids == seq.block_table and len(seq.block_table) == 4
