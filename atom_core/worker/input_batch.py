"""The worker's own copy of every running request, kept in step with each SchedulerOutput.

The flat batch is built from these states, never from the scheduler's `Sequence` objects: the
worker sees only the plain-data step messages (so a worker in another process, one per rank,
needs nothing else). Tokens the worker sampled itself are appended when their step resolves;
a token still on the device is simply not known yet (its position is past `num_known_tokens`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from atom_core.multimodal.inputs import MultimodalItem
from atom_core.sampling_params import SamplingParams
from atom_core.scheduler_output import NewRequest, SchedulerOutput


@dataclass
class RequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # KV entries before the current step
    num_prompt_logprobs: int = 0  # prompt positions already scored
    state_slot: int = -1  # linear-attention models: the engine's state slot (-1: none)
    mm_items: tuple[MultimodalItem, ...] = ()  # its images (multimodal/inputs.py)
    # A multimodal rotary's prompt positions [3, P] (None: positions are indices) and the delta every
    # later token adds to its index (models/common.py: mrope_positions)
    mrope_positions: np.ndarray | None = None
    rope_delta: int = 0

    @classmethod
    def from_new(cls, new: NewRequest) -> "RequestState":
        return cls(new.req_id, list(new.prompt_token_ids), list(new.output_token_ids), new.sampling_params,
                   num_computed_tokens=new.num_computed_tokens, num_prompt_logprobs=new.num_prompt_logprobs,
                   state_slot=new.state_slot, mm_items=new.mm_items)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_at(self, position: int) -> int | None:
        """The token at `position`, or None while it is a sample still on the device."""
        n = len(self.prompt_token_ids)
        if position < n:
            return self.prompt_token_ids[position]
        position -= n
        return self.output_token_ids[position] if position < len(self.output_token_ids) else None

    def tokens(self, start: int, end: int) -> list[int]:
        """Known tokens [start, end) (prefill chunks only hold known tokens)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]


class InputBatch:
    """Request id -> RequestState. Contract: `update(out)` once per step before building its
    batch (returns the states in batch order); `append_sampled` once per resolved step."""

    def __init__(self) -> None:
        self.requests: dict[str, RequestState] = {}

    def update(self, out: SchedulerOutput) -> list[RequestState]:
        requests = self.requests
        for rid in out.finished_req_ids:
            requests.pop(rid, None)
        for new in out.new_requests:  # a resumed request replaces its stale state
            requests[new.req_id] = RequestState.from_new(new)
        for rid, (start, blocks) in out.new_block_ids.items():
            requests[rid].block_ids[start:] = blocks
        states = [requests[rid] for rid in out.req_ids]
        for state, num_computed in zip(states, out.num_computed_tokens):
            state.num_computed_tokens = num_computed
        return states

    def append_sampled(self, req_ids: list[str], sampled: list[list[int]]) -> None:
        requests = self.requests
        for rid, tokens in zip(req_ids, sampled):
            if tokens and (state := requests.get(rid)) is not None:
                state.output_token_ids.extend(tokens)

    def remove(self, req_ids) -> None:
        for rid in req_ids:
            self.requests.pop(rid, None)
