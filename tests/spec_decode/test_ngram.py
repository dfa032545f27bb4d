"""Prompt lookup over a request's own tokens."""
import numpy as np

from atom_core.spec_decode.ngram import NgramProposer, ngram_lookup
from atom_core.worker.input_batch import RequestState
from atom_core.sampling_params import SamplingParams


def lookup(tokens, k=3, lo=1, hi=3):
    return ngram_lookup(np.asarray(tokens), k, lo, hi)


def test_drafts_what_followed_the_earliest_match_of_the_longest_suffix():
    # suffix [1, 2, 3] occurred at 0 (followed by 9, 9, 1) and at 5 (followed by 7, 8, 1)
    assert lookup([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3]) == [9, 9, 1]
    # the 3-gram [5, 1, 2] never occurred before; the 2-gram [1, 2] did (first at 0)
    assert lookup([1, 2, 4, 4, 1, 2, 6, 5, 1, 2], k=2) == [4, 4]
    # the longest match wins over an earlier shorter one: [8, 1, 2] at 4
    assert lookup([1, 2, 5, 5, 8, 1, 2, 6, 8, 1, 2]) == [6, 8, 1]


def test_a_loop_gets_full_drafts():
    assert lookup([4, 9, 9, 9, 9, 9, 9], k=3, lo=2, hi=3) == [9, 9, 9]  # the latest match would give [9]


def test_no_match_no_drafts_and_min_is_respected():
    assert lookup([1, 2, 3, 4]) == []
    assert lookup([1, 2, 9, 3, 2], lo=2) == []  # only the 1-gram [2] matches
    assert lookup([1, 2, 9, 3, 2], lo=1) == [9, 3, 2]


def test_drafts_may_run_into_the_suffix_and_stop_at_the_end():
    assert lookup([7, 7, 7], k=5) == [7]  # [7, 7] matched at 0: only one token follows it before the end
    assert lookup([4], k=3) == []


def test_proposer_reads_prompt_and_outputs():
    state = RequestState("r", [1, 2, 3, 1], [2], SamplingParams())
    assert NgramProposer(2, 1, 2).propose([state]) == [[3, 1]]
