"""Acceptance counters of speculative decoding (the names mirror vLLM's spec_decode_* metrics)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Cumulative over the engine's life. A draft is one request's proposal for one step;
    accepted_per_position[j] counts drafts whose token j (0-based) was accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position += [0] * (num_draft_tokens - len(self.accepted_per_position))
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify step yields per draft: the accepted ones plus the one it always samples."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_position": list(self.accepted_per_position)}


def spec_decode_summary(stats: dict) -> str:
    """One line for `generate` and the benchmarks, from SpecDecodeStats.as_dict()."""
    drafts, proposed, accepted = stats["num_drafts"], stats["num_draft_tokens"], stats["num_accepted_tokens"]
    if not drafts:
        return "no drafts proposed"
    per_position = ", ".join(f"{n / drafts:.2f}" for n in stats["accepted_per_position"])
    return (f"acceptance rate {accepted / proposed:.1%} ({accepted}/{proposed} draft tokens), "
            f"mean accepted length {1 + accepted / drafts:.2f} over {drafts} drafts, "
            f"accepted per position [{per_position}]")
