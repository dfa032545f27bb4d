"""Proposers draft tokens for a request's next step; the target model verifies them.

Drafts are proposed in the worker when a step's tokens are known (so a proposer may read the
target's state) and travel to the scheduler in ModelRunnerOutput.draft_token_ids; the scheduler
lets the request verify them in its next step, as far as budget, blocks and token limit allow.
A proposer that drafts from the target's hidden states (MTP) sets `uses_target_hidden`: the runner
then also hands it every step's verified hidden rows (`TargetHidden`), prefill chunks included.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from atom_core.config import SpeculativeConfig
    from atom_core.worker.input_batch import RequestState


@dataclass
class TargetHidden:
    """The target's final hidden states (after its final norm: what the model returns and its LM
    head reads) of the step that just resolved. Request i of the step (states[i]) has num_rows[i]
    verified rows (its scheduled tokens plus its accepted drafts; rejected drafts' rows are left
    out) at hidden[row_starts[i]:], for positions first_positions[i] onwards."""

    hidden: "torch.Tensor"  # [rows of the step, hidden_size]
    states: list["RequestState"]
    row_starts: list[int]
    first_positions: list[int]
    num_rows: list[int]


class Proposer(ABC):
    """Contract: `propose(states, target)` returns, per request state (all tokens known, the
    newest last), up to `num_draft_tokens` draft ids; an empty list means no speculation next
    step. It must not change the states. `target` is the step's TargetHidden when the proposer
    `uses_target_hidden` (then it is called after every step, with `states` possibly empty)."""

    uses_target_hidden = False

    def __init__(self, num_draft_tokens: int):
        self.num_draft_tokens = num_draft_tokens

    @abstractmethod
    def propose(self, states: list["RequestState"], target: TargetHidden | None = None) -> list[list[int]]: ...

    # A proposer with a model of its own also keeps KV (sized with the target's blocks).
    def kv_layers(self) -> list:
        return []

    def allocate_kv(self, num_blocks: int) -> None:
        pass

    def forget(self, req_ids) -> None:
        """The worker dropped these requests (finished or aborted)."""


def can_speculate(params) -> bool:
    """Requests that draft: not under a grammar (it must see each token before masking the next)
    and without stop strings (the text would stop inside a verified run, after tokens the
    client should not get)."""
    return getattr(params, "structured_outputs", None) is None and not params.stop


def check_proposer(config: "SpeculativeConfig", target) -> None:
    """What can be checked before the target's weights load (a missing MTP layer fails now, not
    after minutes of loading). target: the ResolvedModel."""
    if config.method == "mtp":
        from atom_core.spec_decode.mtp import check_nextn_layer

        check_nextn_layer(target)


def build_proposer(config: "SpeculativeConfig", target=None, block_size: int = 16,
                   max_num_seqs: int = 1, target_model=None) -> Proposer | None:
    """target: the ResolvedModel (a draft model takes its dtype, device and vocabulary);
    target_model: the built target (MTP reuses its decoder-layer class, embedding and head)."""
    if config.method is None:
        return None
    if config.method == "ngram":
        from atom_core.spec_decode.ngram import NgramProposer

        return NgramProposer(config.num_draft_tokens, *config.ngram_window)
    if config.method == "draft":
        from atom_core.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(config, target, block_size, max_num_seqs)
    if config.method == "mtp":
        from atom_core.spec_decode.mtp import MTPProposer

        return MTPProposer(config, target, target_model, block_size, max_num_seqs)
    raise ValueError(f"unknown speculative method {config.method!r}")
