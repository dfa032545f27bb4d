"""The sizes a graph runner captured, and which of them a step pads to.

Decode graphs (cuda_graph.py) count requests, piecewise graphs (piecewise.py) count tokens; both
replay a step at the smallest captured size that holds it.
"""
from __future__ import annotations

import bisect


def padded_size(sizes: tuple[int, ...], n: int) -> int | None:
    """Smallest of `sizes` (sorted) >= n, or None when n is larger than all of them."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class CapturedSizes:
    """Base of the graph runners. Contract: the subclass sets `sizes` (sorted, at least one) in its
    constructor; `can_run(n)` says whether a step of n requests or tokens fits the largest graph,
    `padded_size(n)` which captured size it replays at."""

    sizes: tuple[int, ...]

    def can_run(self, n: int) -> bool:
        return n <= self.sizes[-1]

    def padded_size(self, n: int) -> int | None:
        return padded_size(self.sizes, n)
