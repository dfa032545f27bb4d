"""Continuous batching: each step spends a token budget on running and waiting sequences.

The scheduler thinks in tokens, not phases: a sequence has `num_tokens` known and
`num_computed_tokens` in the KV cache; each step computes some of the difference. A decode is
one token, a prefill chunk many; both share a step. When blocks run out the newest running
sequence is preempted (its blocks freed, recomputed later from its tokens, output unchanged).
"""
from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass, field

from atom_core.engine.kv_cache import KVCacheManager
from atom_core.engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """What the runner computes this step: seqs[i] advances by num_new_tokens[i] tokens."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    # Multi-step decode window: num_steps forwards back to back on the device; seqs[i] keeps
    # the first step_counts[i] of its samples (fewer when it reaches its token limit).
    step_counts: list[int] | None = None

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_steps(self) -> int:
        return max(self.step_counts) if self.step_counts else 1

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @functools.cached_property
    def is_decode_only(self) -> bool:
        """Every sequence computes its one pending token and samples. Read only after scheduling
        (cached: the runner asks several times per step)."""
        return all(
            n == 1 and s.num_computed_tokens + 1 == s.num_tokens and s.num_output_tokens > 0
            for s, n in zip(self.seqs, self.num_new_tokens)
        )

    def samples(self, i: int) -> bool:
        """Whether sequence i reaches its last known token this step, so it samples a new one."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] == seq.num_tokens


class Scheduler:
    """FCFS continuous batching with chunked prefill and preemption by recompute.

    Contract: `schedule()` mutates block tables (through the KV manager) and queues;
    `update_from_output()` advances sequences by what the runner computed and returns the
    sequences that finished. `finish_requests` ends requests from outside (abort, stop string).
    """

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: set[int], enable_chunked_prefill: bool = True,
                 num_scheduler_steps: int = 1):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.enable_chunked_prefill = enable_chunked_prefill
        self.num_scheduler_steps = num_scheduler_steps
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        max_tokens = seq.sampling_params.max_tokens
        limit = self.max_model_len if max_tokens is None else seq.num_prompt_tokens + max_tokens
        seq.token_limit = min(limit, self.max_model_len)
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- scheduling ----------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        block_size = self.kv.block_size
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_tokens = len(seq.token_ids)
            if num_tokens >= seq.token_limit:  # its in-flight token is its last: nothing to run
                i += 1
                continue
            n = min(num_tokens - seq.num_computed_tokens, budget)
            if seq.num_computed_tokens + n <= len(seq.block_table) * block_size:  # fits: the common decode
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                budget -= n
                i += 1
                continue
            while not self.kv.can_append_slots(seq, seq.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                self.kv.append_slots(seq, seq.num_computed_tokens + n)
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                budget -= n
                i += 1
        if not preempted:
            budget = self._schedule_waiting(batch, budget)
            if self.num_scheduler_steps > 1 and batch.seqs and not self.waiting:
                self._plan_window(batch)
        return batch

    def _plan_window(self, batch: ScheduledBatch) -> None:
        """Turn a decode-only batch into a multi-step window when every sequence allows it.

        Each sequence keeps at most the steps left to its token limit and gets KV slots for
        them now. A waiting request would sit out the whole window, so there is none (checked
        by the caller); a window that does not fit in free blocks falls back to one step (the
        blocks already added stay with their sequences, which fill them later).
        """
        if not batch.is_decode_only:
            return
        steps = self.num_scheduler_steps
        counts = []
        for seq in batch.seqs:
            params = seq.sampling_params
            if not params.allows_multi_step or seq.num_output_tokens < params.min_tokens:
                return
            count = min(steps, seq.token_limit - len(seq.token_ids))
            end = seq.num_computed_tokens + count
            if end > len(seq.block_table) * self.kv.block_size:
                if not self.kv.can_append_slots(seq, end):
                    return
                self.kv.append_slots(seq, end)
            counts.append(count)
        if max(counts) > 1:
            batch.step_counts = counts

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            remaining = seq.num_tokens - self.kv.get_prefix_hit_tokens(seq)
            n = min(remaining, budget)
            if n < remaining and not self.enable_chunked_prefill:
                break
            if not self.kv.can_allocate(seq, n):
                break
            self.waiting.popleft()
            num_cached = self.kv.allocate(seq, n)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return budget

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ---- after the step ------------------------------------------------------------
    def advance(self, batch: ScheduledBatch) -> None:
        """Right after launch: count the computed tokens; each sampling sequence gets a
        placeholder for its new token, so the next step can be scheduled before it is known."""
        finished_status = SequenceStatus.FINISHED
        if batch.step_counts is not None:  # a decode window: every sequence samples `count` tokens
            for seq, count in zip(batch.seqs, batch.step_counts):
                if seq.status is not finished_status:
                    seq.num_computed_tokens += count
                    seq.append_placeholders(count)
            return
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.status is finished_status:
                continue
            samples = seq.num_computed_tokens + n == len(seq.token_ids)
            seq.num_computed_tokens += n
            if samples:
                seq.append_placeholder()

    def resolve(self, batch: ScheduledBatch, sampled: list) -> list[Sequence]:
        """The step's tokens arrived: fill placeholders, publish full blocks, stop sequences.

        sampled[i] is sequence i's token, or None when it did not sample; for a decode window
        it is the list of the window's tokens, cut here (in place) after a stop.
        """
        if batch.step_counts is not None:
            return self._resolve_window(batch, sampled)
        finished = []
        block_size = self.kv.block_size
        finished_status = SequenceStatus.FINISHED
        for seq, token_id in zip(batch.seqs, sampled):
            if seq.status is finished_status:  # aborted or stopped while the step ran
                continue
            if token_id is not None:
                seq.resolve_placeholder(token_id)
            if min(seq.num_computed_tokens, seq.num_known_tokens) // block_size > seq.num_hashed_blocks:
                self.kv.cache_full_blocks(seq)  # a block just filled up
            if token_id is None:
                continue
            reason = self._check_stop(seq, token_id)
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    def _resolve_window(self, batch: ScheduledBatch, sampled: list[list[int]]) -> list[Sequence]:
        finished = []
        block_size = self.kv.block_size
        finished_status = SequenceStatus.FINISHED
        for i, (seq, tokens) in enumerate(zip(batch.seqs, sampled)):
            if seq.status is finished_status:
                continue
            for k, token_id in enumerate(tokens):
                seq.resolve_placeholder(token_id)
                reason = self._check_stop(seq, token_id)
                if reason is not None:
                    self._finish(seq, reason)
                    finished.append(seq)
                    sampled[i] = tokens[: k + 1]
                    break
            else:
                if min(seq.num_computed_tokens, seq.num_known_tokens) // block_size > seq.num_hashed_blocks:
                    self.kv.cache_full_blocks(seq)
        return finished

    def update_from_output(self, batch: ScheduledBatch, sampled: list[int | None]) -> list[Sequence]:
        """Synchronous form of advance + resolve."""
        self.advance(batch)
        return self.resolve(batch, sampled)

    def _check_stop(self, seq: Sequence, token_id: int) -> FinishReason | None:
        params = seq.sampling_params
        num_known = len(seq.token_ids) - seq.num_placeholders
        num_outputs = num_known - seq.num_prompt_tokens
        if num_outputs >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                seq.stop_token_id = token_id
                return FinishReason.STOP
            if token_id in params.stop_token_ids:
                seq.stop_token_id = token_id
                return FinishReason.STOP
        if params.max_tokens is not None and num_outputs >= params.max_tokens:
            return FinishReason.LENGTH
        if num_known >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish(reason)
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.kv.free(seq)
        self.kv.forget(seq)
        del self.requests[seq.request_id]

    def finish_requests(self, request_ids: list[str], reason: FinishReason) -> list[Sequence]:
        """End requests from outside the step (client abort, stop string); unknown ids ignored."""
        done = []
        for rid in request_ids:
            seq = self.requests.get(rid)
            if seq is not None and not seq.is_finished:
                self._finish(seq, reason)
                done.append(seq)
        return done
