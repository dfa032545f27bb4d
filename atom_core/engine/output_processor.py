"""Consumer side of the engine core: token deltas in, text, stop strings and timings out.

Shared by the in-process LLMEngine and the server's API process, so both detokenize and
stop identically. A stop string ends a request here; the caller then aborts it in the core.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from atom_core.engine.detokenizer import IncrementalDetokenizer, batch_decoder, decode_step, find_stop
from atom_core.sampling_params import SamplingParams


@dataclass(slots=True)
class CoreOutput:
    """What the core reports per request per step (crosses the process boundary; picklable)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    stop_token_id: int | None = None
    new_logprobs: list = field(default_factory=list)  # per new token: (logprob, {id: logprob})
    prompt_logprobs: list | None = None  # full list, sent once, first entry None
    num_cached_tokens: int = 0
    # With a request's first token(s): seconds in the core's queue (arrival to first
    # scheduled) and in prefill (first scheduled to first token).
    queue_time: float | None = None
    prefill_time: float | None = None


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    arrival_time: float = field(default_factory=time.perf_counter)
    stream_callback: Callable | None = None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0
    queue_time: float | None = None  # in the core (see CoreOutput)
    prefill_time: float | None = None
    sent_tokens: int = 0
    sent_chars: int = 0
    # (core sent, API process received) as time.monotonic() of the oldest update not yet written to
    # the client; set by the server's AsyncEngine, cleared by a consumer that measures it.
    update_stamps: tuple[float, float] | None = None

    @property
    def holdback(self) -> int:
        """Chars kept back while streaming: a partial stop string must not leak out."""
        if self.finished or not self.params.stop:
            return 0
        return max(len(s) for s in self.params.stop) - 1

    def take_delta(self) -> tuple[str, list[int]]:
        """New text and token ids since the last call (for streaming)."""
        end = max(self.sent_chars, len(self.text) - self.holdback)
        text, self.sent_chars = self.text[self.sent_chars : end], end
        ids, self.sent_tokens = self.token_ids[self.sent_tokens :], len(self.token_ids)
        return text, ids

    @property
    def ttft(self) -> float:
        return (self.first_token_time or self.finish_time or time.perf_counter()) - self.arrival_time

    @property
    def latency(self) -> float:
        return (self.finish_time or time.perf_counter()) - self.arrival_time

    @property
    def tpot(self) -> float:
        n = len(self.token_ids)
        return (self.latency - self.ttft) / (n - 1) if n > 1 else 0.0

    def as_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "text": self.text,
            "token_ids": list(self.token_ids),
            "latency": self.latency,
            "finish_reason": self.finish_reason,
            "num_tokens_input": len(self.prompt_token_ids),
            "num_tokens_output": len(self.token_ids),
            "ttft": self.ttft,
            "tpot": self.tpot,
            "logprobs": self.logprobs if self.params.logprobs is not None else None,
            "prompt_logprobs": self.prompt_logprobs,
        }


class OutputProcessor:
    """Applies CoreOutputs to RequestStates. Returns (updated states, ids to abort in the core)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._decoder = batch_decoder(tokenizer) if tokenizer is not None else None
        self.states: dict[str, RequestState] = {}

    def new_state(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                  params: SamplingParams, stream_callback: Callable | None = None) -> RequestState:
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
        state = RequestState(request_id, prompt, list(prompt_token_ids), params, detok, stream_callback=stream_callback)
        self.states[request_id] = state
        return state

    def process(self, outputs: list[CoreOutput]) -> tuple[list[RequestState], list[str]]:
        updated, to_abort = [], []
        now = time.perf_counter()
        batch: dict[str, tuple[RequestState, CoreOutput]] = {}
        for out in outputs:
            if out.request_id in batch:  # a second update of one request: the first one's text comes first
                self._apply(list(batch.values()), now, updated, to_abort)
                batch = {}
            state = self.states.get(out.request_id)
            if state is None or state.finished:
                continue
            if out.prompt_logprobs is not None:
                state.prompt_logprobs = out.prompt_logprobs
            state.num_cached_tokens = out.num_cached_tokens or state.num_cached_tokens
            if out.new_token_ids and state.first_token_time is None:
                state.first_token_time = now
            if out.queue_time is not None:
                state.queue_time, state.prefill_time = out.queue_time, out.prefill_time
            state.token_ids.extend(out.new_token_ids)
            state.logprobs.extend(out.new_logprobs)
            batch[out.request_id] = (state, out)
        self._apply(list(batch.values()), now, updated, to_abort)
        return updated, to_abort

    def _apply(self, batch: list[tuple[RequestState, CoreOutput]], now: float, updated: list[RequestState],
               to_abort: list[str]) -> None:
        """Text, stop strings and endings of one update per request (all decoded together)."""
        for (state, out), delta in zip(batch, self._detokenize(batch)):
            if delta is not None and self._append_text(state, delta):
                to_abort.append(out.request_id)
            elif out.finished:
                state.finished, state.finish_reason = True, out.finish_reason
                state.stop_reason = out.stop_token_id
                if state.detokenizer is not None:
                    state.text += state.detokenizer.flush()
            if state.finished:
                state.finish_time = now
                del self.states[out.request_id]
            updated.append(state)

    def _detokenize(self, batch: list[tuple[RequestState, CoreOutput]]) -> list[str | None]:
        """Each update's new text (None: no tokenizer), one batched decode for the whole step."""
        detokenizers = []
        for state, out in batch:
            if state.detokenizer is None:
                continue
            ids = out.new_token_ids
            if out.finished and out.stop_token_id is not None and ids and ids[-1] == out.stop_token_id:
                ids = ids[:-1]  # the stop token itself is not part of the text
            state.detokenizer.append(ids)
            detokenizers.append(state.detokenizer)
        deltas = iter(decode_step(detokenizers, self._decoder))
        return [next(deltas) if state.detokenizer is not None else None for state, _ in batch]

    def _append_text(self, state: RequestState, delta: str) -> bool:
        """Add the new text; True when a stop string ended the request."""
        state.text += delta
        if not delta or not state.params.stop:
            return False
        hit = find_stop(state.text, len(delta), state.params.stop)
        if hit is None:
            return False
        idx, stop = hit
        state.text = state.text[: idx + len(stop)] if state.params.include_stop_str_in_output else state.text[:idx]
        state.finished, state.finish_reason, state.stop_reason = True, "stop", stop
        return True

    def abort(self, request_id: str) -> None:
        self.states.pop(request_id, None)
