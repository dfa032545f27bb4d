"""Continuous batching: each step spends a token budget on running and waiting sequences.

The scheduler thinks in tokens, not phases: a sequence has `num_tokens` known and
`num_computed_tokens` in the KV cache; each step computes some of the difference. A decode is
one token, a prefill chunk many; both share a step. When blocks run out the newest running
sequence is preempted (its blocks freed, recomputed later from its tokens, output unchanged).
"""
from __future__ import annotations

import time
from collections import deque

from atom_core.config import ResolvedModel, SchedulerConfig
from atom_core.engine.encoder_cache import EncoderCacheManager
from atom_core.engine.kv_cache import KVCacheManager
from atom_core.engine.sequence import FinishReason, Sequence, SequenceStatus
from atom_core.multimodal.inputs import encoder_cache_rows
from atom_core.scheduler_output import PLACEHOLDER, ModelRunnerOutput, NewRequest, SchedulerOutput
from atom_core.spec_decode.stats import SpecDecodeStats

# A capped mixed step's token count is a multiple of this: it lands on a piecewise graph bucket and
# on whole 128-row tiles of the GEMMs. Row counts between multiples of 128 pay for a partial tile
# and can make cuBLAS pick a slower kernel (it did for gate_up at 448 rows; measured: see
# docs/PERFORMANCE.md).
MIXED_STEP_GRANULE = 128

# The prefill hold (SchedulerConfig.prefill_hold_fraction) admits the prompts once no request has joined
# the queue for this many steps: a closed loop's returning streams arrive about one a step while a wave
# forms, with gaps when the client is slow, and open-loop traffic at light load rarely twice in a row.
HOLD_QUIET_STEPS = 2


class Scheduler:
    """FCFS continuous batching with chunked prefill and preemption by recompute.

    Contract: `schedule()` mutates block tables (through the KV manager) and queues;
    `update_from_output()` advances sequences by what the runner computed and returns the
    sequences that finished. `finish_requests` ends requests from outside (abort, stop string).
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int, eos_token_ids,
                 num_speculative_tokens: int = 0, max_loras: int = 0, max_image_tokens: int = 0):
        """max_image_tokens: the placeholders of the largest image the model's processor makes (0: no images)."""
        self.kv = kv
        # > 0: LoRA adapters on; the running sequences use at most this many distinct adapters (so no
        # step mixes more than the worker's GPU slots hold): a waiting request of another adapter waits
        self.max_loras = max_loras
        self.num_speculative_tokens = num_speculative_tokens  # > 0: decodes verify drafts, no windows
        self.spec_stats = SpecDecodeStats()
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.num_scheduler_steps = config.num_scheduler_steps
        self.prefill_pacing_steps = config.prefill_pacing_steps
        self.prefill_pacing_min_tokens = config.prefill_pacing_min_tokens
        self.mixed_step_tokens_per_seq = config.mixed_step_tokens_per_seq
        self.mixed_step_min_tokens = config.mixed_step_min_tokens
        self.prefill_hold_fraction = config.prefill_hold_fraction
        self.prefill_hold_max_steps = config.prefill_hold_max_steps
        self._admitting_prompts = False  # the prefill hold: prompts are being admitted (a wave)
        self.num_schedule_calls = 0  # the clock of the prefill hold
        self.max_model_len = max_model_len
        # Images: encoder outputs the worker holds (the worker's memory profile holds as many rows)
        self.encoder = EncoderCacheManager(encoder_cache_rows(config.max_num_batched_tokens, max_image_tokens))
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self._finished_ids: list[str] = []  # ended since the last schedule(): the worker forgets them

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        max_tokens = seq.sampling_params.max_tokens
        limit = self.max_model_len if max_tokens is None else seq.num_prompt_tokens + max_tokens
        seq.token_limit = min(limit, self.max_model_len)
        seq.queued_step = self.num_schedule_calls
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
    def schedule(self) -> SchedulerOutput:
        self.num_schedule_calls += 1
        out = SchedulerOutput()
        scheduled: list[Sequence] = []
        budget = self.max_num_batched_tokens
        prompt_budget = self._prompt_budget()
        preempted = False
        i = 0
        block_size = self.kv.block_size
        self.encoder.begin_step()
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_tokens = len(seq.token_ids)
            if num_tokens >= seq.token_limit:  # its in-flight token is its last: nothing to run
                i += 1
                continue
            n = min(num_tokens - seq.num_computed_tokens, budget)
            is_chunk = n > 1  # a prompt chunk (or a preempted sequence's recompute): paced
            if is_chunk:
                n = min(n, prompt_budget)
            if seq.mm_items:  # stops before an image the step cannot encode
                n = self.encoder.fit_chunk(seq, seq.num_computed_tokens, n)
            if n == 0:
                i += 1
                continue
            if is_chunk:
                prompt_budget -= n
            if seq.num_computed_tokens + n > len(seq.block_table) * block_size:  # needs a block
                while not self.kv.can_append_slots(seq, seq.num_computed_tokens + n):
                    victim = self.running.pop()
                    self._preempt(victim)
                    preempted = True
                    if victim is seq:
                        break
                else:
                    self.kv.append_slots(seq, seq.num_computed_tokens + n)
                if seq.status is SequenceStatus.WAITING:  # preempted itself
                    continue
            scheduled.append(seq)
            out.add(seq.request_id, n, seq.num_computed_tokens)
            if seq.mm_items:
                self.encoder.commit_chunk(seq, seq.num_computed_tokens, n, out)
            budget -= n
            if seq.draft_token_ids:
                budget -= self._schedule_drafts(seq, out, n, budget)
            i += 1
        if not preempted:
            self._schedule_waiting(out, scheduled, min(budget, prompt_budget))
        out.is_decode_only = _is_decode_only(out, scheduled) and not out.has_drafts
        if out.is_decode_only and self.num_scheduler_steps > 1 and not self.waiting and not self.num_speculative_tokens:
            self._plan_window(out, scheduled)
        self._send_new_blocks(out, scheduled)
        if scheduled:  # an empty step is not run: its news waits for the next one
            out.finished_req_ids, self._finished_ids = self._finished_ids, []
            out.freed_encoder_hashes = self.encoder.take_freed()
        return out

    def _prompt_budget(self) -> int:
        """Prompt tokens this step may carry: the whole budget, unless sequences decode and a cap
        is on (SchedulerConfig): pacing, max(min tokens, outstanding prompt tokens / pacing steps);
        the mixed-step cap, what the decodes leave of R tokens per live request (to the nearest granule,
        at least the cap's minimum, at most the budget), never less than one granule; the prefill
        hold, none while it holds and the whole budget while it admits."""
        if not (self.prefill_pacing_steps or self.mixed_step_tokens_per_seq or self.prefill_hold_fraction):
            return self.max_num_batched_tokens
        outstanding, decodes, starting = 0, 0, len(self.waiting)
        for seq in self.running:
            pending = len(seq.token_ids) - seq.num_computed_tokens
            if pending > 1:
                outstanding += pending
                starting += 1
            elif pending == 1 and len(seq.token_ids) < seq.token_limit:
                decodes += 1
        if self.prefill_hold_fraction:
            return self.max_num_batched_tokens if self._admits_prompts(starting, decodes) else 0
        if not decodes:
            return self.max_num_batched_tokens
        if self.mixed_step_tokens_per_seq:
            live = len(self.running) + len(self.waiting)
            granule = MIXED_STEP_GRANULE
            # to the nearest granule: rounding down cut the cap by a quarter whenever one of 64 streams
            # was between requests (R = 8: 504 -> 384 tokens)
            cap = (self.mixed_step_tokens_per_seq * live + granule // 2) // granule * granule
            cap = min(max(self.mixed_step_min_tokens, cap), self.max_num_batched_tokens)
            return max(granule, cap - decodes * (1 + self.num_speculative_tokens))
        outstanding += sum(seq.num_tokens - seq.num_computed_tokens for seq in self.waiting)
        return max(self.prefill_pacing_min_tokens, -(-outstanding // self.prefill_pacing_steps))

    def _admits_prompts(self, starting: int, decodes: int) -> bool:
        """The prefill hold: whether prompts may run this step. A wave of admissions starts when nothing
        decodes, when at least prefill_hold_fraction of the live requests are starting, when no request
        has joined the queue for HOLD_QUIET_STEPS steps, or when the oldest waiting one has waited
        prefill_hold_max_steps steps; it lasts until none is starting. Holding the first prompts back
        while the rest of a closed loop's streams finish and return lets the wave run beside few decodes,
        so fewer streams stall for each full-budget prompt step; a queue that stopped growing is not
        waiting for a wave, so a lone request under light load waits only a couple of steps."""
        last = self.num_schedule_calls - 1  # requests queued since the previous step carry this
        queued = [seq.queued_step for seq in self.waiting]
        if starting == queued.count(last):  # only the newcomers start: any wave before them has ended
            self._admitting_prompts = False
        if starting and not self._admitting_prompts:
            live = len(self.running) + len(self.waiting)
            quiet = last - max(queued, default=last - HOLD_QUIET_STEPS)  # steps since the newest joined
            waited = last + 1 - min(queued, default=last + 1)  # the oldest's wait, this step included
            self._admitting_prompts = (decodes == 0 or starting >= self.prefill_hold_fraction * live
                                       or quiet >= HOLD_QUIET_STEPS or waited >= self.prefill_hold_max_steps)
        return self._admitting_prompts

    def _plan_window(self, out: SchedulerOutput, seqs: list[Sequence]) -> None:
        """Turn a decode-only batch into a multi-step window when every sequence allows it:
        each gets extra tokens to generate (PLACEHOLDERs) and KV slots for them now.

        The window is num_scheduler_steps long, or, while every sequence may still stop at a stop
        token, as long as the most tokens any of them has generated (1, 2, 4, ... then the full
        window): a stop inside a window leaves the rest of it, and the window already launched after
        it, running for nothing, and a short answer would otherwise pay several windows for a few
        tokens. Each sequence keeps at most the steps left to its token limit. A waiting request
        would sit out the whole window, so there is none, and the batch is decode-only (the caller
        checks both; a preempted sequence waits, so a preempting step never plans one); a window that
        does not fit in free blocks falls back to one step (the blocks already added stay with their
        sequences, which fill them later).
        """
        length = 1
        for seq in seqs:
            params = seq.sampling_params
            if not params.allows_multi_step or seq.num_output_tokens < params.min_tokens:
                return
            may_stop = params.stop_token_ids or (self.eos_token_ids and not params.ignore_eos)
            wanted = min(self.num_scheduler_steps, seq.num_output_tokens) if may_stop else self.num_scheduler_steps
            length = max(length, wanted)
        counts = []
        for seq in seqs:
            count = min(length, seq.token_limit - len(seq.token_ids))
            end = seq.num_computed_tokens + count
            if end > len(seq.block_table) * self.kv.block_size:
                if not self.kv.can_append_slots(seq, end):
                    return
                self.kv.append_slots(seq, end)
            counts.append(count)
        if max(counts) > 1:
            out.extra_tokens = [[PLACEHOLDER] * (count - 1) for count in counts]

    def _schedule_drafts(self, seq: Sequence, out: SchedulerOutput, n: int, budget: int) -> int:
        """Let a decoding sequence verify its drafts after its pending token: as many as the budget,
        its token limit and free blocks allow (drafts never preempt anyone). Returns how many."""
        drafts, seq.draft_token_ids = seq.draft_token_ids, []
        if n != 1 or seq.num_placeholders or seq.num_computed_tokens + 1 != seq.num_tokens:
            return 0
        k = min(len(drafts), budget, seq.token_limit - seq.num_tokens - 1)
        end = seq.num_computed_tokens + 1 + k
        if k <= 0 or not self.kv.can_append_slots(seq, end):
            return 0
        self.kv.append_slots(seq, end)
        out.extra_tokens[-1] = drafts[:k]
        return k

    def _schedule_waiting(self, out: SchedulerOutput, scheduled: list[Sequence], budget: int) -> None:
        adapters = {s.lora_int_id for s in self.running} - {None} if self.max_loras else set()
        skipped: list[Sequence] = []  # waiting on an adapter slot; they keep their place in the queue
        self._admit(out, scheduled, budget, adapters, skipped)
        self.waiting.extendleft(reversed(skipped))

    def _admit(self, out: SchedulerOutput, scheduled: list[Sequence], budget: int, adapters: set[int],
               skipped: list[Sequence]) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            lora_id = seq.lora_int_id
            if lora_id is not None and lora_id not in adapters and len(adapters) >= self.max_loras:
                skipped.append(self.waiting.popleft())
                continue
            hit = self.kv.get_prefix_hit_tokens(seq)
            remaining = seq.num_tokens - hit
            n = min(remaining, budget)
            if seq.mm_items:
                n = self.encoder.fit_chunk(seq, hit, n)
            if n == 0 or (n < remaining and not self.enable_chunked_prefill):
                break
            if not self.kv.can_allocate(seq, n):
                break
            self.waiting.popleft()
            num_cached = self.kv.allocate(seq, n)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached
                seq.first_scheduled_time = time.perf_counter()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(seq)
            out.add(seq.request_id, n, seq.num_computed_tokens)
            out.new_requests.append(NewRequest(
                seq.request_id, seq.prompt_token_ids, seq.output_token_ids, seq.sampling_params,
                seq.num_computed_tokens, len(seq.prompt_logprobs), seq.state_slot, seq.mm_items))
            if seq.mm_items:
                self.encoder.commit_chunk(seq, seq.num_computed_tokens, n, out)
            seq.num_sent_blocks = 0
            budget -= n
            if lora_id is not None:
                adapters.add(lora_id)

    def _send_new_blocks(self, out: SchedulerOutput, seqs: list[Sequence]) -> None:
        """Each scheduled request's blocks the worker does not know yet (a new request's all)."""
        for seq in seqs:
            start = seq.num_sent_blocks
            if len(seq.block_table) > start:
                out.new_block_ids[seq.request_id] = (start, seq.block_table[start:])
                seq.num_sent_blocks = len(seq.block_table)

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        self.encoder.drop(seq)
        seq.draft_token_ids = []
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        seq.queued_step = self.num_schedule_calls
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ---- after the step ------------------------------------------------------------
    def advance(self, out: SchedulerOutput) -> None:
        """Right after launch: count the computed tokens; each sampling sequence gets a
        placeholder per token it samples, so the next step can be scheduled before they are known."""
        for rid, n, extra in zip(out.req_ids, out.num_scheduled_tokens, out.extra_tokens):
            seq = self.requests.get(rid)
            if seq is None:  # finished while the step was being built
                continue
            samples = seq.num_computed_tokens + n == len(seq.token_ids)
            seq.num_computed_tokens += n + len(extra)
            if seq.mm_items:
                self.encoder.advance(seq)
            if samples:
                seq.append_placeholders(1 + len(extra))

    def resolve(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[Sequence]:
        """The step's tokens arrived: fill placeholders, publish full blocks, stop sequences.

        result.sampled[i] lists request i's new tokens; a stop inside them cuts the list here
        (in place), and the placeholders after it are dropped.
        """
        finished = []
        block_size = self.kv.block_size
        for i, (rid, tokens, extra) in enumerate(zip(out.req_ids, result.sampled, out.extra_tokens)):
            seq = self.requests.get(rid)
            if seq is None:  # aborted or stopped while the step ran
                continue
            is_verify = bool(extra) and extra[0] != PLACEHOLDER
            if is_verify:
                self.spec_stats.observe(len(extra), len(tokens) - 1)
            reason = None
            for k, token_id in enumerate(tokens):
                seq.resolve_placeholder(token_id)
                reason = self._check_stop(seq, token_id)
                if reason is not None:
                    del tokens[k + 1 :]
                    seq.drop_placeholders()
                    break
            if is_verify and seq.num_placeholders:  # rejected drafts: their KV slots go back
                seq.drop_placeholders()
                self.kv.trim_slots(seq, seq.num_tokens - 1)
            if reason is None and i in result.draft_token_ids:
                seq.draft_token_ids = result.draft_token_ids[i]
            if min(seq.num_computed_tokens, seq.num_known_tokens) // block_size > seq.num_hashed_blocks:
                self.kv.cache_full_blocks(seq)  # a block just filled up
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[Sequence]:
        """Synchronous form of advance + resolve."""
        self.advance(out)
        return self.resolve(out, result)

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
        self.encoder.drop(seq)
        del self.requests[seq.request_id]
        self._finished_ids.append(seq.request_id)

    def finish_requests(self, request_ids: list[str], reason: FinishReason) -> list[Sequence]:
        """End requests from outside the step (client abort, stop string); unknown ids ignored."""
        done = []
        for rid in request_ids:
            seq = self.requests.get(rid)
            if seq is not None and not seq.is_finished:
                self._finish(seq, reason)
                done.append(seq)
        return done


def _is_decode_only(out: SchedulerOutput, seqs: list[Sequence]) -> bool:
    """Every sequence computes its one pending token and samples (read right after scheduling)."""
    return bool(seqs) and all(
        n == 1 and s.num_computed_tokens + 1 == s.num_tokens and s.num_output_tokens > 0
        for s, n in zip(seqs, out.num_scheduled_tokens)
    )
