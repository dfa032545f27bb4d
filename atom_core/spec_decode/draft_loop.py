"""One step of a hidden-state drafter (MTP, EAGLE-3) on the device: the catch-up forward over the
step's verified rows, then K - 1 later drafts, one row per drafting request, each one position
further than the last.

Nothing returns to the host between the forwards: a later draft's input token is the previous
draft; its positions, KV slots and sequence lengths are known on the host before the loop (each
request's last position plus j, looked up in its block table: `later_layout`) and travel in the
step's one host-to-device copy, so the loop launches no index arithmetic between the forwards.
It runs eagerly or inside one CUDA graph alike (spec_decode/mtp_graphs.py), and the caller reads
every draft with one host sync.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
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
    later: dict[str, torch.Tensor] | None = None  # later_layout's arrays on the device (K > 1)


LATER_KEYS = ("later_positions", "later_slots", "later_seq_lens", "later_qsl")


def later_layout(last_positions: np.ndarray, tables: np.ndarray, mask: np.ndarray | None, num_later: int,
                 block_size: int) -> dict[str, np.ndarray]:
    """Host arrays of the K - 1 later drafts of E requests (last_positions [E]: each request's last
    verified position; tables [E, W] covering its drafts; mask [E]: the rows that draft, None:
    all): later draft j (0-based) of request e sits at last + 1 + j, in slot `later_slots[j, e]`
    (-1 for masked rows, which run at position j: inside the rotary table) with
    seq_len position + 1; later_qsl steps by one row."""
    base = last_positions.astype(np.int64) if mask is None else np.where(mask, last_positions, -1).astype(np.int64)
    positions = base[None, :] + np.arange(1, num_later + 1, dtype=np.int64)[:, None]  # [K-1, E]
    blocks = np.take_along_axis(tables.astype(np.int64), (positions // block_size).T, axis=1).T
    slots = blocks * block_size + positions % block_size
    if mask is not None:
        slots = np.where(mask[None, :], slots, -1)
    return {"later_positions": positions, "later_slots": slots, "later_seq_lens": (positions + 1).astype(np.int32),
            "later_qsl": np.arange(base.shape[0] + 1, dtype=np.int32)}


def later_draft_metadata(j: int, c: CatchUp) -> AttentionMetadata:
    """Later draft j's metadata: one row per request over the catch-up's tables (later_layout's)."""
    later = c.later
    return AttentionMetadata(query_start_loc=later["later_qsl"], seq_lens=later["later_seq_lens"][j],
                             block_tables=c.tables, slot_mapping=later["later_slots"][j], max_query_len=1,
                             max_seq_len=c.max_seq_len, seq_order=c.meta.seq_order)


def run_drafts(layer: nn.Module, embed: nn.Module, greedy: Callable[[torch.Tensor], torch.Tensor], c: CatchUp,
               num_drafts: int, done: Callable[[list[torch.Tensor]], bool] | None = None) -> torch.Tensor:
    """[E, num_drafts] draft ids: the catch-up forward (every row, so the layer's KV holds each
    verified position), the first draft from each request's last real row, then num_drafts - 1
    later forwards (c.later: their metadata). `layer.forward_nextn(ids, positions, previous,
    embed, rows)` is the drafter's forward (the outputs of `rows` only, every row's KV stored);
    `greedy` maps its [E, H] outputs to target token ids. done(drafts so far) -> True ends the
    loop early (fewer columns): a host read of the drafts, for devices where that costs no sync
    (the CPU); None runs all K."""
    with set_attention_metadata(c.meta):
        hidden = layer.forward_nextn(c.ids, c.positions, c.previous, embed, c.last)
    tokens = [greedy(hidden)]
    if num_drafts == 1 or (done is not None and done(tokens)):
        return tokens[0].unsqueeze(1)
    assert c.later is not None, "later drafts need later_layout's metadata"
    for j in range(num_drafts - 1):
        with set_attention_metadata(later_draft_metadata(j, c)):
            hidden = layer.forward_nextn(tokens[-1], c.later["later_positions"][j], hidden, embed)
        tokens.append(greedy(hidden))
        if done is not None and done(tokens):
            break
    return torch.stack(tokens, dim=1)
