"""An engine core whose model step is a stand-in: a fixed device time, no model, no tensors.

The real scheduler, KV manager, async stepping and CoreOutputs run; only the executor differs.
`StandInExecutor.launch` returns at once and marks when the "device" finishes the step (one step
after another, like a GPU stream); `resolve` sleeps until then and returns one token per
sampling request. So the core's host work overlaps the step as it does on a GPU, and the API
process downstream sees the message rate and sizes a real run would send it.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

from atom_core.config import EngineConfig
from atom_core.engine.core import EngineCore
from atom_core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from atom_core.worker.executor import Executor


@dataclass
class _Handle:
    req_ids: list[str]
    sampled: list[list[int]]
    ready_at: float  # time.monotonic() when the stand-in device has finished this step
    event: None = None  # no device event to wait on (core._profiled_launch reads it)


class StandInExecutor(Executor):
    """Steps cost `step_s` of (simulated) device time each, back to back; tokens are random ids
    in [0, vocab_size). Contract as Executor: resolve in launch order."""

    def __init__(self, config: EngineConfig, vocab_size: int, max_model_len: int, step_s: float, seed: int = 0):
        assert step_s >= 0, f"step_s must be >= 0, got {step_s}"
        block = config.cache.block_size
        # Room for every running request at full length: the benchmark measures the host path,
        # never preemption.
        self.num_kv_blocks = config.cache.num_kv_blocks or config.scheduler.max_num_seqs * -(-max_model_len // block)
        self.step_s = step_s
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self.lengths: dict[str, int] = {}  # tokens a request has (known or sampled in a launched step)
        self.device_free_at = 0.0
        self.num_steps = 0

    def launch(self, out: SchedulerOutput, previous=None) -> _Handle:
        for rid in out.finished_req_ids:
            self.lengths.pop(rid, None)
        for new in out.new_requests:
            self.lengths[new.req_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
        sampled = []
        for rid, n, start, extra in zip(out.req_ids, out.num_scheduled_tokens, out.num_computed_tokens,
                                        out.extra_tokens):
            if start + n < self.lengths[rid]:  # a prefill chunk short of the prompt's end
                sampled.append([])
                continue
            tokens = [self.rng.randrange(self.vocab_size) for _ in range(1 + len(extra))]
            self.lengths[rid] += len(tokens)
            sampled.append(tokens)
        self.device_free_at = max(time.monotonic(), self.device_free_at) + self.step_s
        self.num_steps += 1
        return _Handle(list(out.req_ids), sampled, self.device_free_at)

    def resolve(self, handle: _Handle) -> ModelRunnerOutput:
        wait = handle.ready_at - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        return ModelRunnerOutput(handle.req_ids, handle.sampled)

    def graph_batch_size(self, out: SchedulerOutput) -> int | None:
        return None

    @property
    def startup_breakdown(self) -> dict[str, float]:
        return {}


class StandInCore(EngineCore):
    """EngineCore with a StandInExecutor: build it with `functools.partial(StandInCore, step_s=...)`
    as AsyncEngine's core_factory. Refuses what the stand-in cannot produce (logprobs, grammars)."""

    def __init__(self, config: EngineConfig, step_s: float = 0.0):
        self._step_s = step_s
        super().__init__(config)

    def _make_executor(self) -> StandInExecutor:
        return StandInExecutor(self.config, self.vocab_size, self.max_model_len, self._step_s)

    def validate_request(self, prompt_token_ids, params, mm_items=()) -> None:
        if params.logprobs is not None or params.prompt_logprobs is not None or params.structured_outputs is not None:
            raise ValueError("the stand-in core samples random tokens: no logprobs or structured outputs")
        if mm_items:
            raise ValueError("the stand-in core samples random tokens: no images")
        super().validate_request(prompt_token_ids, params)
