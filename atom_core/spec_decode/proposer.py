"""Proposers draft tokens for a request's next step; the target model verifies them.

Drafts are proposed in the worker when a step's tokens are known (so a proposer may read the
target's state) and travel to the scheduler in ModelRunnerOutput.draft_token_ids; the scheduler
lets the request verify them in its next step, as far as budget, blocks and token limit allow.
A proposer that drafts from the target's hidden states (MTP) sets `uses_target_hidden`: the runner
then also hands it every step's verified hidden rows (`TargetHidden`), prefill chunks included.
Without speculative decoding the runner holds a `NoProposer`, which drafts nothing.

spec_decode/ sits below worker/: it reads the worker's request states through `RequestView`
and captures CUDA graphs through the `CaptureGraphs` callable the runner hands it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    import torch

    from atom_core.sampling_params import SamplingParams
    from atom_core.scheduler_output import ModelRunnerOutput


class RequestView(Protocol):
    """What a proposer reads of a request: the worker's RequestState (worker/input_batch.py)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: "SamplingParams"
    block_ids: list[int]

    @property
    def num_known_tokens(self) -> int: ...

    def tokens(self, start: int, end: int) -> list[int]: ...


# capture(forward, sizes, max_model_len, query_len) -> a captured graph runner (worker/cuda_graph.py's
# CUDAGraphRunner: can_run(requests), replay(step), query_len, capture_seconds) in the target's graph pool.
CaptureGraphs = Callable[..., object]


@dataclass
class TargetHidden:
    """The target's final hidden states (after its final norm: what the model returns and its LM
    head reads) of the step that just resolved. Request i of the step (states[i]) has num_rows[i]
    verified rows (its scheduled tokens plus its accepted drafts; rejected drafts' rows are left
    out) at hidden[row_starts[i]:], for positions first_positions[i] onwards."""

    hidden: "torch.Tensor"  # [rows of the step, hidden_size]
    states: list[RequestView]
    row_starts: list[int]
    first_positions: list[int]
    num_rows: list[int]


class Proposer(ABC):
    """Contract: `propose(states, target)` returns, per request state (all tokens known, the
    newest last), up to `num_draft_tokens` draft ids; an empty list means no speculation next
    step. It must not change the states. `target` is the step's TargetHidden when the proposer
    `uses_target_hidden` (then it is called after every step, with `states` possibly empty).
    `draft(result, requests, target)` is what the runner calls once a step's tokens are known.
    The other methods default to "nothing": no KV, no graphs, nothing to forget."""

    uses_target_hidden = False

    def __init__(self, num_draft_tokens: int):
        self.num_draft_tokens = num_draft_tokens

    @abstractmethod
    def propose(self, states: list[RequestView], target: TargetHidden | None = None) -> list[list[int]]: ...

    def draft(self, result: "ModelRunnerOutput", requests: dict[str, RequestView],
              target: TargetHidden | None) -> dict[int, list[int]]:
        """Drafts (batch index -> ids) for every request of `result` that just gained tokens and
        may speculate; `requests`: the worker's states by id, already holding those tokens."""
        idx = [i for i, (rid, toks) in enumerate(zip(result.req_ids, result.sampled))
               if toks and rid in requests and can_speculate(requests[rid].sampling_params)]
        if not idx and target is None:
            return {}
        drafts = self.propose([requests[result.req_ids[i]] for i in idx], target)
        return {i: d for i, d in zip(idx, drafts) if d}

    # A proposer with a model of its own also keeps KV (sized with the target's blocks).
    def kv_layers(self) -> list:
        return []

    def allocate_kv(self, num_blocks: int) -> None:
        pass

    def forget(self, req_ids) -> None:
        """The worker dropped these requests (finished or aborted)."""

    # A proposer whose own forwards replay CUDA graphs (MTP) captures them beside the target's.
    def capture_graphs(self, decode_sizes: tuple[int, ...], capture: CaptureGraphs) -> None:
        pass

    def release_graphs(self) -> None:
        pass

    @property
    def graph_capture_seconds(self) -> float:
        return 0.0


class NoProposer(Proposer):
    """Speculative decoding off: drafts nothing, so no step verifies and no verify graphs exist
    (num_draft_tokens 0); it has no KV and no graphs."""

    def __init__(self) -> None:
        super().__init__(0)

    def propose(self, states: list[RequestView], target: TargetHidden | None = None) -> list[list[int]]:
        return [[] for _ in states]

    def draft(self, result: "ModelRunnerOutput", requests: dict[str, RequestView],
              target: TargetHidden | None) -> dict[int, list[int]]:
        return {}  # without the per-request scan of Proposer.draft: plain decoding pays nothing


def can_speculate(params) -> bool:
    """Requests that draft: not under a grammar (it must see each token before masking the next)
    and without stop strings (the text would stop inside a verified run, after tokens the
    client should not get)."""
    return getattr(params, "structured_outputs", None) is None and not params.stop
