"""Which proposer a speculative config builds, and what can be checked before the target loads.

Apart from proposer.py so that the proposers, which subclass `Proposer`, import it without the
base module importing them back.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from atom_core.spec_decode.proposer import NoProposer, Proposer

if TYPE_CHECKING:
    from atom_core.config import SpeculativeConfig


def check_proposer(config: "SpeculativeConfig", target) -> None:
    """What can be checked before the target's weights load (a missing MTP layer fails now, not
    after minutes of loading). target: the ResolvedModel."""
    if config.method == "mtp":
        from atom_core.spec_decode.mtp import check_nextn_layer

        check_nextn_layer(target)
    if config.method == "eagle3":
        from atom_core.spec_decode.eagle3 import check_eagle3_head

        check_eagle3_head(config, target)


def build_proposer(config: "SpeculativeConfig", target=None, block_size: int = 16,
                   max_num_seqs: int = 1, target_model=None, max_num_tokens: int = 1) -> Proposer:
    """target: the ResolvedModel (a draft model takes its dtype, device and vocabulary);
    target_model: the built target (MTP reuses its decoder-layer class, embedding and head; EAGLE-3
    its embedding and hidden states); max_num_tokens: the most tokens one step computes."""
    if config.method is None:
        return NoProposer()
    if config.method == "ngram":
        from atom_core.spec_decode.ngram import NgramProposer

        return NgramProposer(config.num_draft_tokens, *config.ngram_window)
    if config.method == "draft":
        from atom_core.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(config, target, block_size, max_num_seqs)
    if config.method == "mtp":
        from atom_core.spec_decode.mtp import MTPProposer

        return MTPProposer(config, target, target_model, block_size, max_num_seqs)
    if config.method == "eagle3":
        from atom_core.spec_decode.eagle3 import Eagle3Proposer

        return Eagle3Proposer(config, target, target_model, block_size, max_num_seqs, max_num_tokens)
    raise ValueError(f"unknown speculative method {config.method!r}")
