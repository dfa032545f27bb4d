"""SamplingParams: how one request picks its tokens and when it stops."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from atom_core.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    from atom_core.lora import LoRARequest


@dataclass
class SamplingParams:
    """Per-request sampling knobs, validated on construction (ValueError names the field).
    Treat as immutable once built: derived flags (is_greedy, has_penalties) are cached.

    temperature == 0 means greedy. Penalties follow vLLM: repetition_penalty (HF style, over
    prompt and output tokens, 1.0 = off), presence/frequency penalties over output tokens.
    `seed` makes the request's samples reproducible whatever else shares its batch.
    `logprobs` = k returns the chosen token's logprob and the top-k per step (0: chosen only);
    `prompt_logprobs` = k returns the same for every prompt token (first one is None).
    `logit_bias` {token id: bias in [-100, 100]} adds each bias to that token's logit before every
    sample (OpenAI's logit_bias: -100 bans a token in practice, +100 all but forces it); the ids must be
    below the model's vocabulary size (checked when the request is added). `allowed_token_ids` (vLLM's)
    samples only among those ids (the min_tokens ban still applies within them).
    `structured_outputs` constrains the output to a grammar (JSON schema, regex, choice, ...).
    `lora_request` names the LoRA adapter the request runs with (None: the base model); it rides here so
    every boundary a request crosses carries it unchanged. So does `cache_salt` (vLLM's): requests with
    different salts (or one without) never share prefix-cache blocks, whatever their prompts.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    lora_request: LoRARequest | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        def fail(name: str, why: str) -> None:
            raise ValueError(f"invalid sampling parameter {name}={getattr(self, name)!r}: {why}")

        if not self.temperature >= 0:
            fail("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            fail("top_p", "must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            fail("top_k", "must be -1 (off) or >= 1")
        if not 0 <= self.min_p <= 1:
            fail("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            fail("max_tokens", "must be >= 1")
        if self.min_tokens < 0:
            fail("min_tokens", "must be >= 0")
        if not self.repetition_penalty > 0:
            fail("repetition_penalty", "must be > 0")
        if not -2 <= self.presence_penalty <= 2:
            fail("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            fail("frequency_penalty", "must be in [-2, 2]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 20:
                fail(name, "must be between 0 and 20")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            fail("seed", "must be a non-negative 64-bit integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", "stop strings must be non-empty strings")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                fail("logit_bias", "must be a mapping of token ids to biases")
            for token, bias in self.logit_bias.items():
                if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                    fail("logit_bias", f"token ids must be integers >= 0, got {token!r}")
                if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                    fail("logit_bias", f"the bias of token {token} must be a number in [-100, 100], got {bias!r}")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or any(
                    isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
                fail("allowed_token_ids", "must be a non-empty list of token ids >= 0")
            self.allowed_token_ids = list(ids)
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            fail("cache_salt", "must be a non-empty string")
        if self.structured_outputs is not None and self.min_tokens > 0:
            # min_tokens bans EOS where the grammar may allow nothing else.
            fail("min_tokens", "must be 0 with structured outputs")

    @functools.cached_property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @functools.cached_property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @functools.cached_property
    def allows_multi_step(self) -> bool:
        """Whether several decode steps may run on the device before the host sees the tokens.
        Penalties and logprobs need every token on the host, and a stop string may end the
        request inside a window, after tokens the client should not see. A grammar must see each
        token before it can mask the next one."""
        return (not self.has_penalties and self.logprobs is None and not self.stop
                and self.structured_outputs is None)
