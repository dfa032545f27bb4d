"""What crosses between the engine core and the worker each step: plain data, no live objects.

The scheduler produces a `SchedulerOutput`; the worker keeps its own copy of every running
request (prompt, known outputs, block table) and updates it from each output, so it never
reads the scheduler's `Sequence` objects (and, under tensor parallelism, the same message can
go to every rank). The worker answers with a `ModelRunnerOutput`: a list of tokens per request.

"Several tokens per request in one step" has one representation: `extra_tokens[i]`, the
tokens a request computes after its scheduled one. PLACEHOLDER entries are tokens to generate
(a multi-step decode window: each is sampled on the device and fed to the next forward);
known token ids would be drafts to verify (speculative decoding).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from atom_core.multimodal.inputs import MultimodalItem
from atom_core.sampling_params import SamplingParams

PLACEHOLDER = -1  # a token sampled on the device whose value the host does not know yet


@dataclass(frozen=True)
class NewRequest:
    """A request the worker has not seen, or one resuming after preemption (its known outputs
    are recomputed as prompt-like tokens). Its blocks come in SchedulerOutput.new_block_ids."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    num_computed_tokens: int  # prefix-cache hit: tokens already in the KV cache
    num_prompt_logprobs: int = 0  # prompt positions already scored (an entry per position, from 0)
    state_slot: int = -1  # linear-attention models: the sequence's state slot (-1: none; engine/kv_cache.py)
    mm_items: tuple[MultimodalItem, ...] = ()  # its images, in prompt order (multimodal/README.md)


@dataclass
class SchedulerOutput:
    """One step. Entry i of the batch is request req_ids[i], which computes
    num_scheduled_tokens[i] tokens from position num_computed_tokens[i], then extra_tokens[i]."""

    req_ids: list[str] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)  # before this step
    extra_tokens: list[list[int]] = field(default_factory=list)
    new_requests: list[NewRequest] = field(default_factory=list)
    # request id -> (start, ids): its block table from index `start` on is `ids` (a new request
    # starts at 0; a table trimmed by a KV rollback is rewritten from the cut).
    new_block_ids: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    finished_req_ids: list[str] = field(default_factory=list)  # since the last step: forget them
    is_decode_only: bool = False  # every entry computes its one pending token and samples
    # Structured outputs: the entries that sample under a grammar this step, and their allowed
    # tokens (row r for grammar_req_ids[r]; int32 [rows, ceil(V / 32)], bit j of word w = token
    # 32 w + j). Empty / None when no request in the step has a grammar.
    grammar_req_ids: list[str] = field(default_factory=list)
    grammar_bitmask: object = None  # numpy int32 array
    # Images: (request id, index into its mm_items) to encode this step, each content hash once (the
    # others that need it read the same output); encoder outputs the worker drops before the step.
    encoder_items: list[tuple[str, int]] = field(default_factory=list)
    freed_encoder_hashes: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.req_ids)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    # Cached: read several times per step, and only once the scheduler has filled the output.
    @functools.cached_property
    def num_steps(self) -> int:
        """Forwards this step runs back to back (> 1 only for a multi-step decode window)."""
        return 1 + max((len(e) for e in self.extra_tokens), default=0)

    @functools.cached_property
    def is_window(self) -> bool:
        return self.num_steps > 1 and all(t == PLACEHOLDER for e in self.extra_tokens for t in e)

    @functools.cached_property
    def has_drafts(self) -> bool:
        """Some request verifies draft tokens (known ids in extra_tokens) this step."""
        return any(e and e[0] != PLACEHOLDER for e in self.extra_tokens)

    def add(self, req_id: str, num_tokens: int, num_computed: int) -> None:
        self.req_ids.append(req_id)
        self.num_scheduled_tokens.append(num_tokens)
        self.num_computed_tokens.append(num_computed)
        self.extra_tokens.append([])


# (chosen logprob, {token id: logprob} of the top-k) for one sampled or prompt position.
Logprob = tuple[float, dict[int, float]]


@dataclass
class ModelRunnerOutput:
    """The step's results, aligned with SchedulerOutput.req_ids: sampled[i] holds request i's new
    tokens (empty for a prefill chunk that does not reach its last token; several for a window)."""

    req_ids: list[str]
    sampled: list[list[int]]
    logprobs: dict[int, list[Logprob]] = field(default_factory=dict)  # batch index -> per new token
    prompt_logprobs: dict[int, list[Logprob]] = field(default_factory=dict)  # batch index -> new entries
    # batch index -> draft tokens proposed for the request's next step (speculative decoding)
    draft_token_ids: dict[int, list[int]] = field(default_factory=dict)
