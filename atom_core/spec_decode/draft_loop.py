"""One step of a hidden-state drafter (MTP, EAGLE-3) on the device: the catch-up forward over the
step's verified rows, then K - 1 later drafts, one row per drafting request, each one position
further than the last.

Nothing returns to the host between the forwards: a later draft's input token is the previous
draft, its positions, KV slots and sequence lengths come from the previous positions and the
catch-up's block tables by tensor ops. So the loop runs eagerly or inside one CUDA graph alike
(spec_decode/mtp_graphs.py), and the caller reads every draft with one host sync.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from atom_core.model_ops.forward_context import AttentionMetadata, set_attention_metadata


@dataclass
class CatchUp:
    """A catch-up forward's inputs on the device, and where its drafting requests sit in it."""

    ids: torch.Tensor  # [N] token t+1 of each row
    positions: torch.Tensor  # [N] position t of each row
    previous: torch.Tensor  # [N, H] the hidden state each row reads (the target's, or fused by EAGLE-3's fc)
    meta: AttentionMetadata
    last: torch.Tensor  # [E] each drafting request's last real row (an index into the N rows)
    tables: torch.Tensor  # [E, W] int32 their block tables (covering their drafts' positions)
    max_seq_len: int  # a host-side bound on the later drafts' seq_lens (kernel grids)
    mask: torch.Tensor | None = None  # [E] bool: rows that draft (graph padding does not); None: all


def later_draft_metadata(positions: torch.Tensor, c: CatchUp, qsl: torch.Tensor, block_size: int) -> AttentionMetadata:
    """One row per request at `positions` [E], over the catch-up's tables; rows masked off store
    nothing (slot -1)."""
    blocks = c.tables.gather(1, (positions // block_size).unsqueeze(1)).squeeze(1).long()
    slots = blocks * block_size + positions % block_size
    if c.mask is not None:
        slots = torch.where(c.mask, slots, -1)
    return AttentionMetadata(query_start_loc=qsl, seq_lens=(positions + 1).to(torch.int32), block_tables=c.tables,
                             slot_mapping=slots, max_query_len=1, max_seq_len=c.max_seq_len,
                             seq_order=c.meta.seq_order)


def run_drafts(layer: nn.Module, embed: nn.Module, greedy: Callable[[torch.Tensor], torch.Tensor], c: CatchUp,
               num_drafts: int, block_size: int,
               done: Callable[[list[torch.Tensor]], bool] | None = None) -> torch.Tensor:
    """[E, num_drafts] draft ids: the catch-up forward (every row, so the layer's KV holds each
    verified position), the first draft from each request's last real row, then num_drafts - 1
    later forwards. `layer.forward_nextn(ids, positions, previous, embed, rows)` is the drafter's
    forward (the outputs of `rows` only, every row's KV stored); `greedy` maps its [E, H] outputs
    to target token ids. done(drafts so far) -> True ends the loop early (fewer columns): a host
    read of the drafts, for devices where that costs no sync (the CPU); None runs all K."""
    with set_attention_metadata(c.meta):
        hidden = layer.forward_nextn(c.ids, c.positions, c.previous, embed, c.last)
    tokens = [greedy(hidden)]
    if num_drafts == 1 or (done is not None and done(tokens)):
        return tokens[0].unsqueeze(1)
    positions = c.positions.index_select(0, c.last)
    if c.mask is not None:  # masked rows read position 0 (a position past the rotary table would fault)
        positions = torch.where(c.mask, positions, -1)
    qsl = torch.arange(positions.shape[0] + 1, dtype=torch.int32, device=positions.device)
    for _ in range(num_drafts - 1):
        positions = positions + 1
        with set_attention_metadata(later_draft_metadata(positions, c, qsl, block_size)):
            hidden = layer.forward_nextn(tokens[-1], positions, hidden, embed)
        tokens.append(greedy(hidden))
        if done is not None and done(tokens):
            break
    return torch.stack(tokens, dim=1)
