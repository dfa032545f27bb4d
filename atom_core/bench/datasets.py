"""Prompt sets for the serving benchmark: random, sharegpt, custom and prefix-repetition.

Every sampler returns `SampleRequest`s whose `prompt_len` is *measured*: it is the number of
tokens the server's tokenizer produces for the prompt, special tokens included
(`tokenizer(prompt).input_ids`, the way a completions server tokenizes it). Samplers take a
`seed` and draw from their own RNGs, so the same seed gives the same prompts.

Random lengths. A random token-id sequence does not survive decode -> encode unchanged (pieces
merge or split), so the random samplers decode, re-tokenize, and grow or trim the text until
the count is right. With BPE/SentencePiece tokenizers this hits the requested length exactly
in practice; the guaranteed tolerance is `length_tolerance(n)` = max(2 tokens, 1% of n). A
prompt that still misses it after `_MAX_FIT_ROUNDS` rounds raises ValueError.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from atom_core.bench.lengths import Length, fit_lengths
from atom_core.bench.names import DATASET_NAMES, DatasetName  # noqa: F401 - re-exported

_MAX_FIT_ROUNDS = 16


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens, as the server will count them (text only: random-mm's images come on top)
    expected_output_len: int  # max_tokens sent with the request
    images: tuple[str, ...] = ()  # image data: URLs sent with the prompt (random-mm)


@dataclass(frozen=True)
class DatasetConfig:
    """Which prompts to send; validated on construction."""

    name: str = "random"
    path: str | None = None
    # random; None: the default (DEFAULT_RANDOM_LENS), shrunk by `fit_to_model` where the server's
    # max_model_len is shorter
    random_input_len: int | None = None
    random_output_len: int | None = None
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    apply_chat_template: bool = False
    # sharegpt: None keeps each conversation's own completion length
    sharegpt_output_len: int | None = None
    # custom: per-line "output_len" wins over this
    custom_output_len: int = 256
    # prefix-repetition
    prefix_repetition_prefix_len: int = 256
    prefix_repetition_suffix_len: int = 256
    prefix_repetition_num_prefixes: int = 10
    prefix_repetition_output_len: int = 128
    # random-mm (bench/mm_dataset.py): the random dataset's text plus images, in vLLM's terms
    random_mm_base_items_per_request: int = 1
    random_mm_num_mm_items_range_ratio: float = 0.0
    random_mm_limit_mm_per_prompt: str | None = None
    random_mm_bucket_config: str = "{(256, 256, 1): 0.5, (720, 1280, 1): 0.5}"

    def __post_init__(self) -> None:
        if self.name not in DATASET_NAMES:
            raise ValueError(f"unknown dataset '{self.name}'; expected one of: {', '.join(DATASET_NAMES)}")
        if self.name in ("sharegpt", "custom"):
            if not self.path:
                raise ValueError(f"dataset '{self.name}' needs --dataset-path")
            if not Path(self.path).is_file():
                raise ValueError(f"dataset path '{self.path}' does not exist or is not a file")
        if not 0.0 <= self.random_range_ratio < 1.0:
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {self.random_range_ratio}")
        positive = {
            "--random-input-len": self.input_len,
            "--random-output-len": self.output_len,
            "--custom-output-len": self.custom_output_len,
            "--prefix-repetition-num-prefixes": self.prefix_repetition_num_prefixes,
            "--prefix-repetition-output-len": self.prefix_repetition_output_len,
        }
        non_negative = {
            "--random-prefix-len": self.random_prefix_len,
            "--prefix-repetition-prefix-len": self.prefix_repetition_prefix_len,
            "--prefix-repetition-suffix-len": self.prefix_repetition_suffix_len,
        }
        for flag, value in positive.items():
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        for flag, value in non_negative.items():
            if value < 0:
                raise ValueError(f"{flag} must be >= 0, got {value}")
        if self.sharegpt_output_len is not None and self.sharegpt_output_len < 1:
            raise ValueError(f"--sharegpt-output-len must be >= 1, got {self.sharegpt_output_len}")
        if self.random_mm_base_items_per_request < 0:
            raise ValueError(f"--random-mm-base-items-per-request must be >= 0, got {self.random_mm_base_items_per_request}")
        if not 0.0 <= self.random_mm_num_mm_items_range_ratio <= 1.0:
            raise ValueError(f"--random-mm-num-mm-items-range-ratio must be in [0, 1], got "
                             f"{self.random_mm_num_mm_items_range_ratio}")
        if self.name == "random-mm":
            from atom_core.bench.mm_dataset import parse_buckets, parse_item_limit

            parse_buckets(self.random_mm_bucket_config)
            parse_item_limit(self.random_mm_limit_mm_per_prompt)

    @property
    def input_len(self) -> int:
        """random: the prompt length to draw around (the default when not given)."""
        return DEFAULT_RANDOM_LENS[0] if self.random_input_len is None else self.random_input_len

    @property
    def output_len(self) -> int:
        return DEFAULT_RANDOM_LENS[1] if self.random_output_len is None else self.random_output_len


DEFAULT_RANDOM_LENS = (1024, 128)  # vLLM's --random-input-len and --random-output-len

# The flags that shorten each dataset's requests, for the error when they do not fit the model.
LENGTH_FLAGS = {
    "random": "--random-input-len, --random-output-len or --random-range-ratio",
    "random-mm": "--random-input-len, --random-output-len, --random-range-ratio or the image sizes",
    "sharegpt": "--sharegpt-output-len (ShareGPT prompts run to 1,024 tokens), or serve a longer --max-model-len",
    "custom": "--custom-output-len or the prompts of --dataset-path",
    "prefix-repetition": "--prefix-repetition-prefix-len, --prefix-repetition-suffix-len or "
                         "--prefix-repetition-output-len",
}


def fit_to_model(cfg: DatasetConfig, max_model_len: int) -> tuple[DatasetConfig, str | None]:
    """The random dataset's default lengths shrunk (in proportion) so that its longest prompt,
    within the length tolerance, plus its longest output fits `max_model_len`; lengths given are
    kept. Returns the config and a notice naming the flags when something was shrunk. Other
    datasets are returned as they are (`check_fit` checks their requests)."""
    if cfg.name not in ("random", "random-mm"):
        return cfg, None
    ratio = 1.0 + cfg.random_range_ratio
    budget = int((max_model_len - length_tolerance(max_model_len)) / ratio)
    fitted = fit_lengths([Length("--random-input-len", cfg.random_input_len, DEFAULT_RANDOM_LENS[0]),
                          Length("--random-output-len", cfg.random_output_len, DEFAULT_RANDOM_LENS[1])],
                         budget, f"the server's max_model_len {max_model_len}")
    return replace(cfg, random_input_len=fitted.values[0], random_output_len=fitted.values[1]), fitted.notice


def check_fit(cfg: DatasetConfig, requests: list[SampleRequest], max_model_len: int) -> None:
    """ValueError naming the dataset's length flags when a request's prompt plus its output
    tokens exceed `max_model_len` (the server would refuse it)."""
    too_long = [r for r in requests if r.prompt_len + r.expected_output_len > max_model_len]
    if too_long:
        worst = max(too_long, key=lambda r: r.prompt_len + r.expected_output_len)
        raise ValueError(f"{len(too_long)} of {len(requests)} requests do not fit the server's max_model_len "
                         f"{max_model_len} (the longest: {worst.prompt_len} prompt + {worst.expected_output_len} "
                         f"output tokens); lower {LENGTH_FLAGS[cfg.name]}")


def length_tolerance(num_tokens: int) -> int:
    """How far a random prompt's measured length may be from the requested one."""
    return max(2, int(0.01 * num_tokens))


def sample_requests(cfg: DatasetConfig, tokenizer: Any, num_requests: int, seed: int) -> list[SampleRequest]:
    if num_requests < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_requests}")
    if cfg.name == "random":
        return sample_random(
            tokenizer, num_requests, cfg.input_len, cfg.output_len,
            cfg.random_range_ratio, cfg.random_prefix_len, seed, cfg.apply_chat_template,
        )
    if cfg.name == "random-mm":
        from atom_core.bench.mm_dataset import with_images

        texts = sample_random(tokenizer, num_requests, cfg.input_len, cfg.output_len, cfg.random_range_ratio,
                              cfg.random_prefix_len, seed, cfg.apply_chat_template)
        return with_images(cfg, texts, seed)
    if cfg.name == "sharegpt":
        return sample_sharegpt(tokenizer, cfg.path, num_requests, cfg.sharegpt_output_len, seed)
    if cfg.name == "custom":
        return sample_custom(tokenizer, cfg.path, num_requests, cfg.custom_output_len, seed, cfg.apply_chat_template)
    return sample_prefix_repetition(
        tokenizer, num_requests, cfg.prefix_repetition_prefix_len, cfg.prefix_repetition_suffix_len,
        cfg.prefix_repetition_num_prefixes, cfg.prefix_repetition_output_len, seed,
    )


# --- random -----------------------------------------------------------------------------


def sample_random(
    tokenizer: Any,
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
    apply_chat_template: bool = False,
) -> list[SampleRequest]:
    """vLLM's random dataset: lengths uniform in [X * (1 - r), X * (1 + r)].

    `input_len` is the whole prompt as the server counts it: shared prefix, random body, special
    tokens and (with `apply_chat_template`) the template's own tokens.
    """
    rng = np.random.default_rng(seed)
    pool = _content_token_ids(tokenizer)
    input_lens = rng.integers(int(input_len * (1 - range_ratio)), int(input_len * (1 + range_ratio)) + 1, num_requests)
    output_lens = rng.integers(
        max(1, int(output_len * (1 - range_ratio))), int(output_len * (1 + range_ratio)) + 1, num_requests
    )
    wrap = _chat_wrapper(tokenizer) if apply_chat_template else (lambda text: text)
    overhead = _count_tokens(tokenizer, wrap(""))
    prefix = _fit_text(tokenizer, rng, pool, "", prefix_len, lambda text: text, add_special_tokens=False)
    requests = []
    for target, out_len in zip(input_lens.tolist(), output_lens.tolist()):
        target = max(target, prefix_len + overhead + 1)
        body = _fit_text(tokenizer, rng, pool, prefix, target, wrap)
        prompt = wrap(prefix + body)
        requests.append(SampleRequest(prompt, _count_tokens(tokenizer, prompt), int(out_len)))
    return requests


def _content_token_ids(tokenizer: Any) -> np.ndarray:
    """Ids that decode on their own to ordinary text: no special or added tokens, and no
    partial UTF-8 pieces (byte tokens), which decode to U+FFFD and re-tokenize as several tokens."""
    special = set(tokenizer.all_special_ids)
    candidates = [i for i in range(tokenizer.vocab_size) if i not in special]
    texts = tokenizer.batch_decode([[i] for i in candidates])
    ids = np.array([i for i, text in zip(candidates, texts) if text.strip() and "\ufffd" not in text], dtype=np.int64)
    if len(ids) == 0:
        raise ValueError("the tokenizer has no ordinary text tokens to build random prompts from")
    return ids


def _chat_wrapper(tokenizer: Any):
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("--apply-chat-template was given but the tokenizer has no chat template")

    def wrap(text: str) -> str:
        messages = [{"role": "user", "content": text}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    return wrap


def _count_tokens(tokenizer: Any, prompt: str, add_special_tokens: bool = True) -> int:
    """Tokens the server sees. A templated prompt already holds its special tokens, and servers
    tokenize it as is; counting BOS twice here would be wrong for Llama-style templates."""
    if add_special_tokens and tokenizer.bos_token and prompt.startswith(tokenizer.bos_token):
        add_special_tokens = False
    return len(tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids)


def _fit_text(
    tokenizer: Any,
    rng: np.random.Generator,
    pool: np.ndarray,
    head: str,
    num_tokens: int,
    wrap,
    add_special_tokens: bool = True,
) -> str:
    """Random text `body` such that wrap(head + body) counts `num_tokens` tokens.

    Decode random ids and re-encode them to get the text's own (canonical) ids; keep the first
    k of those, correcting k by the measured error (merges at the seam make it off by a few);
    if that does not settle, draw new ids.
    """
    if num_tokens <= 0:
        return ""

    def count(body: str) -> int:
        return _count_tokens(tokenizer, wrap(head + body), add_special_tokens)

    base = count("")
    best, best_err = "", base - num_tokens
    for _ in range(_MAX_FIT_ROUNDS):
        if best_err == 0:
            return best
        draw = rng.choice(pool, size=num_tokens - base + 16).tolist()
        ids = tokenizer.encode(tokenizer.decode(draw), add_special_tokens=False)
        k = min(len(ids), max(0, num_tokens - base))
        for _ in range(4):
            body = tokenizer.decode(ids[:k])
            err = count(body) - num_tokens
            if abs(err) < abs(best_err):
                best, best_err = body, err
            next_k = min(len(ids), max(0, k - err))
            if err == 0 or next_k == k:
                break
            k = next_k
    if abs(best_err) > length_tolerance(num_tokens):
        raise ValueError(
            f"could not build a random prompt of {num_tokens} tokens (closest: {num_tokens + best_err}); "
            "the tokenizer does not round-trip random token ids"
        )
    return best


# --- sharegpt ---------------------------------------------------------------------------


def sample_sharegpt(
    tokenizer: Any, path: str | Path, num_requests: int, output_len: int | None = None, seed: int = 0
) -> list[SampleRequest]:
    """vLLM's ShareGPT sampling: first human turn as prompt, first reply sets the output length.

    Conversations are shuffled by seed; too short (< 4 tokens) or too long (prompt > 1024 or
    prompt + output > 2048 tokens) ones are skipped; the set is oversampled when short.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read ShareGPT file '{path}': {err}") from err
    if not isinstance(data, list):
        raise ValueError(f"ShareGPT file '{path}' must hold a JSON list of conversations")
    entries = [e for e in data if isinstance(e, dict) and len(e.get("conversations") or []) >= 2]
    random.Random(seed).shuffle(entries)
    samples: list[SampleRequest] = []
    for entry in entries:
        if len(samples) >= num_requests:
            break
        prompt = entry["conversations"][0]["value"]
        completion = entry["conversations"][1]["value"]
        prompt_len = len(tokenizer(prompt).input_ids)
        new_output_len = output_len if output_len is not None else len(tokenizer(completion).input_ids)
        if _is_valid_sharegpt(prompt_len, new_output_len, output_len is not None):
            samples.append(SampleRequest(prompt, prompt_len, new_output_len))
    if not samples:
        raise ValueError(f"ShareGPT file '{path}' holds no usable conversation")
    return _oversample(samples, num_requests, seed)


def _is_valid_sharegpt(prompt_len: int, output_len: int, fixed_output_len: bool) -> bool:
    if prompt_len < 4 or (not fixed_output_len and output_len < 4):
        return False
    return prompt_len <= 1024 and prompt_len + output_len <= 2048


def _oversample(samples: list[SampleRequest], num_requests: int, seed: int) -> list[SampleRequest]:
    if len(samples) >= num_requests:
        return samples[:num_requests]
    return samples + random.Random(seed).choices(samples, k=num_requests - len(samples))


# --- custom -----------------------------------------------------------------------------


def sample_custom(
    tokenizer: Any,
    path: str | Path,
    num_requests: int,
    output_len: int = 256,
    seed: int = 0,
    apply_chat_template: bool = False,
) -> list[SampleRequest]:
    """JSONL, one object per line: {"prompt": str, "output_len": int (optional)}. File order is kept."""
    wrap = _chat_wrapper(tokenizer) if apply_chat_template else (lambda text: text)
    samples: list[SampleRequest] = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise ValueError(f"cannot read custom dataset '{path}': {err}") from err
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg})") from err
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f"{path}:{lineno}: each line needs a string \"prompt\"")
        out_len = row.get("output_len", output_len)
        if not isinstance(out_len, int) or out_len < 1:
            raise ValueError(f"{path}:{lineno}: \"output_len\" must be a positive integer, got {out_len!r}")
        prompt = wrap(row["prompt"])
        samples.append(SampleRequest(prompt, _count_tokens(tokenizer, prompt), out_len))
        if len(samples) >= num_requests:
            break
    if not samples:
        raise ValueError(f"custom dataset '{path}' holds no prompts")
    return _oversample(samples, num_requests, seed)


# --- prefix repetition ------------------------------------------------------------------


def sample_prefix_repetition(
    tokenizer: Any,
    num_requests: int,
    prefix_len: int = 256,
    suffix_len: int = 256,
    num_prefixes: int = 10,
    output_len: int = 128,
    seed: int = 0,
) -> list[SampleRequest]:
    """Prompts = one of `num_prefixes` shared random prefixes + a fresh random suffix.

    Exercises prefix caching: requests are spread round-robin over the prefixes (so exactly
    `num_requests` come back) and then shuffled by seed. Lengths are fitted like the random set.
    """
    if num_prefixes > num_requests:
        raise ValueError(
            f"--prefix-repetition-num-prefixes ({num_prefixes}) must not exceed --num-prompts ({num_requests})"
        )
    rng = np.random.default_rng(seed)
    pool = _content_token_ids(tokenizer)
    keep = lambda text: text  # noqa: E731
    prefixes = [
        _fit_text(tokenizer, rng, pool, "", prefix_len, keep, add_special_tokens=False) for _ in range(num_prefixes)
    ]
    requests = []
    for i in range(num_requests):
        prefix = prefixes[i % num_prefixes]
        target = _count_tokens(tokenizer, prefix) + suffix_len
        prompt = prefix + _fit_text(tokenizer, rng, pool, prefix, target, keep)
        requests.append(SampleRequest(prompt, _count_tokens(tokenizer, prompt), output_len))
    random.Random(seed).shuffle(requests)
    return requests
