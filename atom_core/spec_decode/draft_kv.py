"""A drafter's own KV cache on the target's block tables, shared by the draft-model and MTP proposers.

The drafter's attention layers get their own cache tensors with the target's block ids and block
size, so the scheduler allocates and frees blocks for both. Positions the target has computed
sit in the request's real blocks; the drafter's speculative positions past them (the pending
token and the drafts) may fall in blocks not allocated yet, so each request slot also owns
NUM_SCRATCH_BLOCKS scratch blocks past the shared ones.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from atom_core.model_ops.forward_context import AttentionMetadata
from atom_core.model_ops.kv_spec import allocate_kv_cache
from atom_core.model_ops.staging import to_device_packed

if TYPE_CHECKING:
    from atom_core.spec_decode.proposer import RequestView

NUM_SCRATCH_BLOCKS = 2  # k <= 8 <= block_size draft positions span at most two new blocks


class DraftKV:
    """Contract: `allocate(num_blocks)` once the target's block count is known; `claim(req_id)`
    before a request's speculative positions are written (False: no slot free, no drafts for
    it this time; preempted requests keep theirs); `release(req_ids)` when the worker drops them."""

    def __init__(self, layers: list, block_size: int, max_num_seqs: int, device: torch.device):
        self.layers = layers
        self.block_size = block_size
        self.device = device
        self.free_scratch = list(range(max_num_seqs))
        self.scratch: dict[str, int] = {}  # request id -> its scratch index
        self.first_scratch_block = 0

    def allocate(self, num_blocks: int) -> None:
        self.first_scratch_block = num_blocks
        allocate_kv_cache(self.layers, num_blocks + NUM_SCRATCH_BLOCKS * len(self.free_scratch), self.block_size,
                          self.device)

    def claim(self, req_id: str) -> bool:
        if req_id not in self.scratch:
            if not self.free_scratch:
                return False
            self.scratch[req_id] = self.free_scratch.pop()
        return True

    def release(self, req_ids) -> None:
        for rid in req_ids:
            if (index := self.scratch.pop(rid, None)) is not None:
                self.free_scratch.append(index)

    def table(self, state: "RequestView", num_real: int) -> list[int]:
        """Block ids for a request whose positions < num_real are the target's: its real blocks
        covering them, then its scratch blocks (if it holds a slot)."""
        real = state.block_ids[: -(-num_real // self.block_size)]
        index = self.scratch.get(state.req_id)
        if index is None:
            return real
        first = self.first_scratch_block + NUM_SCRATCH_BLOCKS * index
        return real + list(range(first, first + NUM_SCRATCH_BLOCKS))

    def layout(self, row_counts: list[int], starts: list[int], tables: list[list[int]],
               num_real: list[int] | None = None) -> dict[str, np.ndarray]:
        """Host arrays of one flat forward: request r computes row_counts[r] rows from position
        starts[r] over its block table tables[r]. With num_real, only its first num_real[r] rows
        store KV (the rest are padding: slot -1, as in padded verify batches), and each table is
        padded with block 0 to cover its seq_len. Keys: positions, and AttentionMetadata's
        query_start_loc, seq_lens, block_tables, slot_mapping (device_metadata's input)."""
        bs = self.block_size
        positions = np.concatenate([np.arange(s, s + n) for n, s in zip(row_counts, starts)])
        real = num_real or row_counts
        slots = [table[p // bs] * bs + p % bs if j < m else -1
                 for n, m, s, table in zip(row_counts, real, starts, tables) for j, p in enumerate(range(s, s + n))]
        seq_lens = [s + n for n, s in zip(row_counts, starts)]
        width = max(max(len(t) for t in tables), max(-(-length // bs) for length in seq_lens))
        return {"positions": positions.astype(np.int64),
                "query_start_loc": np.cumsum([0, *row_counts]).astype(np.int32),
                "seq_lens": np.array(seq_lens, dtype=np.int32),
                "block_tables": np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32),
                "slot_mapping": np.array(slots, dtype=np.int64)}

    def metadata(self, row_counts: list[int], starts: list[int], tables: list[list[int]],
                 num_real: list[int] | None = None):
        """Positions [T] and the AttentionMetadata of `layout`'s forward, on the device (one copy)."""
        host = self.layout(row_counts, starts, tables, num_real)
        return device_metadata(host, to_device_packed(host, self.device))


def device_metadata(host: dict[str, np.ndarray],
                    dev: dict[str, torch.Tensor]) -> tuple[torch.Tensor, AttentionMetadata]:
    """(positions, AttentionMetadata) of DraftKV.layout's arrays: `host` for the host-side bounds,
    `dev` their device copies."""
    meta = AttentionMetadata(query_start_loc=dev["query_start_loc"], seq_lens=dev["seq_lens"],
                             block_tables=dev["block_tables"], slot_mapping=dev["slot_mapping"],
                             max_query_len=int(np.diff(host["query_start_loc"]).max()),
                             max_seq_len=int(host["seq_lens"].max()))
    return dev["positions"], meta
