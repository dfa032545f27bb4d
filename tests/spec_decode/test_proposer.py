"""The Proposer interface the runner calls (spec_decode/proposer.py): which requests `draft` asks
drafts for, and NoProposer, the proposer of a runner without speculative decoding."""
from __future__ import annotations

from atom_core.config import SpeculativeConfig
from atom_core.sampling_params import SamplingParams
from atom_core.scheduler_output import ModelRunnerOutput
from atom_core.spec_decode.ngram import NgramProposer
from atom_core.spec_decode.factory import build_proposer
from atom_core.spec_decode.proposer import NoProposer
from atom_core.worker.input_batch import RequestState

LOOP = [1, 2, 3, 1, 2, 3, 1, 2]  # prompt lookup drafts 3, 1, ... after it


def _requests(**params_of) -> dict[str, RequestState]:
    return {rid: RequestState(rid, list(LOOP), [], SamplingParams(**params)) for rid, params in params_of.items()}


class TestDraft:
    def test_drafts_for_requests_that_gained_tokens_and_may_speculate(self):
        requests = _requests(a={}, b={}, c={"stop": ["x"]})
        result = ModelRunnerOutput(["a", "b", "c", "gone"], [[2], [], [2], [2]])  # b: a chunk; gone: finished
        assert NgramProposer(2, 1, 3).draft(result, requests, None) == {0: [3, 1]}

    def test_requests_without_a_match_get_no_entry(self):
        requests = {"a": RequestState("a", [1, 2, 3, 4], [], SamplingParams())}
        assert NgramProposer(2, 1, 3).draft(ModelRunnerOutput(["a"], [[5]]), requests, None) == {}


class TestNoProposer:
    def test_is_the_proposer_without_a_speculative_method(self):
        proposer = build_proposer(SpeculativeConfig())
        assert isinstance(proposer, NoProposer) and proposer.num_draft_tokens == 0
        assert not proposer.uses_target_hidden

    def test_drafts_nothing(self):
        requests = _requests(a={})
        result = ModelRunnerOutput(["a"], [[2]])
        proposer = NoProposer()
        assert proposer.draft(result, requests, None) == {}
        assert proposer.propose(list(requests.values())) == [[]]

    def test_has_no_kv_and_no_graphs(self):
        proposer = NoProposer()
        assert proposer.kv_layers() == []
        proposer.allocate_kv(8)
        proposer.forget(["a"])
        captured = []
        proposer.capture_graphs((1, 2), lambda *args, **kwargs: captured.append(args))
        proposer.release_graphs()
        assert captured == [] and proposer.graph_capture_seconds == 0.0
