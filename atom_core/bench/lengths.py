"""Fitting a benchmark's token lengths to the model's max_model_len.

A benchmark's default lengths (nano-vllm's prompts of up to 1,024 tokens, vLLM's 1,024-token random
prompts) are longer than a small model's context (the built-in demo model holds 512 tokens), and a
request that cannot fit fails only once the run has started. `fit_lengths` keeps the lengths the
user gave and shrinks the defaults, in proportion, into what those leave; when the given lengths
alone do not fit, the error names their flags.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Length:
    """One length of a request: its flag, the value given (None: the default) and the default."""

    flag: str
    value: int | None
    default: int

    @property
    def given(self) -> bool:
        return self.value is not None


@dataclass(frozen=True)
class FittedLengths:
    values: tuple[int, ...]  # in the order of the lengths passed
    notice: str | None  # what was shrunk and the flags that choose instead; None when nothing was


def fit_lengths(lengths: list[Length], budget: int, limit: str) -> FittedLengths:
    """Lengths whose sum is at most `budget` tokens. `limit` says where the budget comes from
    (e.g. "max_model_len 512"), for the messages. ValueError naming the flags when the lengths
    the user gave leave no room for the others (or exceed the budget themselves)."""
    given = sum(n.value for n in lengths if n.given)
    defaults = [n for n in lengths if not n.given]
    room = budget - given
    if given > budget or room < len(defaults):
        named = " + ".join(f"{n.flag} {n.value}" for n in lengths if n.given)
        flags = ", ".join(n.flag for n in lengths)
        raise ValueError(f"{named} = {given} tokens do not fit {limit}; lower {flags}, "
                         f"or raise the model's --max-model-len")
    wanted = sum(n.default for n in defaults)
    if wanted <= room:
        return FittedLengths(tuple(n.value if n.given else n.default for n in lengths), None)
    scale = room / wanted
    values = tuple(n.value if n.given else max(1, int(n.default * scale)) for n in lengths)
    shrunk = ", ".join(f"{n.flag} {v} (default {n.default})" for n, v in zip(lengths, values) if not n.given)
    return FittedLengths(values, f"note: the default lengths do not fit {limit}; using {shrunk}. "
                                 f"Pass {', '.join(n.flag for n in defaults)} to choose.")
