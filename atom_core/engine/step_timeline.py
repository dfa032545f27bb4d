"""Where a run's wall time goes, step by step, without a profiler (`bench offline --step-timeline`).

Each resolved step is split into prompt work and decodes. An entry of a step is a *decode* when
it schedules exactly one token and its request's prompt is already in the KV cache
(num_computed_tokens >= prompt length); its extra tokens (a decode window's or drafts to verify)
count with it. Every other entry is *prompt* work: a prefill chunk, the last token of a chunked
prompt, a prefix-cache hit's one recomputed token, or a preempted request recomputing its outputs.
A step is `with_prompt` when any entry is prompt work, else `decode_only`. A step's forwards
are its multi-step decode window's length (1 otherwise: drafts are verified in one forward).
"""
from __future__ import annotations

import time
from typing import Callable

from atom_core.scheduler_output import SchedulerOutput

# Decode-only steps by batch size (decodes in the step): (lowest, highest or None for open).
BATCH_BUCKETS = ((1, 8), (9, 32), (33, 64), (65, 128), (129, 256), (257, None))


class StepTimeline:
    """Per-step counts and wall times of one engine core.

    Contract: `start()` once, then `record(out)` once per resolved step, in resolve order
    (EngineCore._resolve: one call per step in the engine process, also under tensor
    parallelism); `summary()` at any time. Single-threaded, as the core. A step's wall time is
    the time since the previous resolve (since `start()` for the first). Under async scheduling
    step N resolves after step N+1 has launched, so that interval is the pipeline's time per step:
    for a GPU-bound run, the device time of step N plus any host time the overlap did not hide.
    (A device that computes at launch, such as the CPU, shifts that by one: the interval then
    holds step N+1's compute.)

    Kept per step: five numbers. Kept per request: its prompt length, learnt from the step
    that sends it to the worker and dropped when the worker is told it finished.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self._start: float | None = None
        # (resolve time, prompt tokens, decode entries, decode tokens incl. their extra tokens, forwards)
        self._steps: list[tuple[float, int, int, int, int]] = []
        self._prompt_lens: dict[str, int] = {}

    def start(self, prompt_lens: dict[str, int] | None = None) -> None:
        """prompt_lens: the requests already running (request id -> prompt length); a request
        never seen counts as past its prompt."""
        self._start = self.clock()
        self._steps = []
        self._prompt_lens = dict(prompt_lens or {})

    def record(self, out: SchedulerOutput) -> None:
        """Count one step as its results arrive; its wall time ends now."""
        now = self.clock()
        assert self._start is not None, "record() before start()"
        lens = self._prompt_lens
        for rid in out.finished_req_ids:
            lens.pop(rid, None)
        for req in out.new_requests:
            lens[req.req_id] = len(req.prompt_token_ids)
        forwards = out.num_steps if out.is_window else 1
        if out.is_decode_only:  # the scheduler checked every entry: no loop over them
            extra = sum(map(len, out.extra_tokens))
            self._steps.append((now, 0, len(out), out.total_tokens + extra, forwards))
            return
        prompt = decodes = decode_tokens = 0
        for rid, n, computed, extra in zip(out.req_ids, out.num_scheduled_tokens, out.num_computed_tokens,
                                           out.extra_tokens):
            if n == 1 and computed >= lens.get(rid, 0):
                decodes += 1
                decode_tokens += 1 + len(extra)
            else:
                prompt += n
        self._steps.append((now, prompt, decodes, decode_tokens, forwards))

    def summary(self) -> dict:
        """Per kind and in total: steps, forwards, seconds, prompt_tokens, decodes (entries),
        decode_tokens, mean_decodes_per_step, mean_ms_per_step; and `decode_only_by_batch`: the
        decode-only steps by their number of decodes ("1-8", ..., ">256"), with the same fields."""
        steps = []  # (seconds, prompt tokens, decodes, decode tokens, forwards)
        previous = self._start
        for now, *counts in self._steps:
            steps.append((now - previous, *counts))
            previous = now
        decode_only = [s for s in steps if not s[1]]
        by_batch = [{"batch": f"{lo}-{hi}" if hi else f">{lo - 1}",
                     **_totals([s for s in decode_only if lo <= s[2] and (hi is None or s[2] <= hi)])}
                    for lo, hi in BATCH_BUCKETS]
        return {"with_prompt": _totals([s for s in steps if s[1]]), "decode_only": _totals(decode_only),
                "total": _totals(steps), "decode_only_by_batch": by_batch}


def _totals(steps: list[tuple[float, int, int, int, int]]) -> dict:
    n, seconds, decodes = len(steps), sum((s[0] for s in steps), 0.0), sum(s[2] for s in steps)
    return {"steps": n, "forwards": sum(s[4] for s in steps), "seconds": seconds,
            "prompt_tokens": sum(s[1] for s in steps), "decodes": decodes, "decode_tokens": sum(s[3] for s in steps),
            "mean_decodes_per_step": decodes / n if n else 0.0, "mean_ms_per_step": 1000 * seconds / n if n else 0.0}
