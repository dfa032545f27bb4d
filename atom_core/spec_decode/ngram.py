"""Prompt lookup: draft the tokens that followed the earliest occurrence of the request's own
most recent n tokens (the longest n from ngram_max down to ngram_min), as vLLM's n-gram proposer
(the earliest match leaves the most tokens after it, e.g. in a loop)."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from atom_core.spec_decode.proposer import Proposer


def ngram_lookup(tokens: np.ndarray, k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Up to k tokens following the earliest match of the longest suffix n-gram."""
    length = len(tokens)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        suffix = tokens[length - n :]
        windows = sliding_window_view(tokens[: length - 1], n)  # every n-gram that ends before the last token
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[0]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer(Proposer):
    def __init__(self, num_draft_tokens: int, ngram_min: int, ngram_max: int):
        super().__init__(num_draft_tokens)
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, states, target=None) -> list[list[int]]:
        return [ngram_lookup(np.asarray(s.prompt_token_ids + s.output_token_ids, dtype=np.int64),
                             self.num_draft_tokens, self.ngram_min, self.ngram_max) for s in states]
