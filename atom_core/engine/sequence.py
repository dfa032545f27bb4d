"""A request's state inside the engine core: tokens, progress, blocks, timings."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import xxhash

from atom_core.multimodal.inputs import MultimodalItem
from atom_core.sampling_params import SamplingParams
from atom_core.scheduler_output import PLACEHOLDER


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"


@dataclass
class Sequence:
    """One request. `token_ids` is the single source of truth for its tokens.

    Tokens [0, num_computed_tokens) have their KV in the cache; the rest are known but not
    yet computed (the prompt's unprocessed part, or the last sampled token). The last
    `num_placeholders` entries are PLACEHOLDER: sampled on the GPU, not yet copied back.
    """

    request_id: str
    token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.perf_counter)
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache, first schedule
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0
    num_sent_blocks: int = 0  # blocks of block_table the worker already knows
    state_slot: int = -1  # linear-attention models: its row in the state pools while it holds one
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    num_preemptions: int = 0
    num_placeholders: int = 0  # sampled tokens still on the GPU (async scheduling), at the end
    token_limit: int = 1 << 62  # prompt + max_tokens, capped by max_model_len (set by the scheduler)
    queued_step: int = 0  # Scheduler.num_schedule_calls when it last joined the waiting queue
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # Per output token: (chosen logprob, {token_id: logprob} of the top-k); when requested.
    output_logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)
    draft_token_ids: list[int] = field(default_factory=list)  # proposed for the next step (speculation)
    mm_items: tuple[MultimodalItem, ...] = ()  # its images, in prompt order (multimodal/inputs.py)
    num_encoder_done: int = 0  # mm_items whose placeholders are all computed (their encoder outputs released)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_known_tokens(self) -> int:
        return len(self.token_ids) - self.num_placeholders

    @property
    def num_known_output_tokens(self) -> int:
        return self.num_known_tokens - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def lora_int_id(self) -> int | None:
        """The request's LoRA adapter (None: the base model)."""
        lora = self.sampling_params.lora_request
        return None if lora is None else lora.lora_int_id

    @property
    def block_hash_seed(self) -> int | None:
        """Where the chain of prefix-cache block hashes starts: requests of different adapters (and the
        base model) or different cache salts (and none) never share KV; None for the base model unsalted."""
        lora_id, salt = self.lora_int_id, self.sampling_params.cache_salt
        if lora_id is None and salt is None:
            return None
        key = b"" if lora_id is None else b"lora" + lora_id.to_bytes(8, "little")
        if salt is not None:
            key += b"salt" + salt.encode()
        return xxhash.xxh64(key).intdigest()

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None

    def append_placeholder(self) -> None:
        self.token_ids.append(PLACEHOLDER)
        self.num_placeholders += 1

    def append_placeholders(self, count: int) -> None:
        self.token_ids.extend([PLACEHOLDER] * count)
        self.num_placeholders += count

    def drop_placeholders(self) -> None:
        """Forget sampled tokens that will never arrive (a window cut short by a stop)."""
        del self.token_ids[len(self.token_ids) - self.num_placeholders :]
        self.num_placeholders = 0

    def resolve_placeholder(self, token_id: int) -> None:
        """Replace the oldest placeholder with the token the GPU sampled."""
        assert self.num_placeholders > 0, f"{self.request_id}: no placeholder to resolve"
        self.token_ids[len(self.token_ids) - self.num_placeholders] = token_id
        self.num_placeholders -= 1
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()

    def finish(self, reason: FinishReason) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.finish_time = time.perf_counter()
