"""CUDA graphs for a hidden-state drafter's step (the MTP layer, an EAGLE-3 head).

Run eagerly, the drafter (a whole decoder block plus its head) costs more than the whole model's
graph-replayed decode step: its time is the launch overhead of a few dozen small kernels and the
host work between them (measured on DeepSeek-V2-Lite: see docs/PERFORMANCE.md). So a step's whole
draft loop (spec_decode/draft_loop.py) replays as ONE graph: the gather of the previous hidden
states (EAGLE-3: and its fc), the catch-up forward, the greedy head of each draft and the K - 1
later drafts. The host lays out the step's inputs (the later drafts' positions and KV slots too, as
draft_loop.later_layout does: _Staging.stage) in one pinned buffer, copies it to the graphs' own input buffer once,
replays, and reads the [requests, K] drafts once.

The catch-up is padded: after a decode or verify step every request has 1 <= n <= q = 1 + K
verified rows. They run padded to q rows a request, as the target's padded verify batches
(worker/verify_batch.py): padding rows take token 0, the hidden state of the request's last real
row and slot -1 (no KV stored); seq_len is first + q, so the causal rows line up and real rows
attend only to positions that this forward or an earlier one wrote. Their outputs are never read.
Requests that do not draft this step (and padding requests) run the later drafts masked: slot -1,
outputs dropped. Steps that hold a prefill chunk (more than q rows for a request) and batches
larger than the largest graph run eagerly.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import torch
from torch import nn

from atom_core.model_ops.forward_context import get_attention_metadata
from atom_core.model_ops.staging import aligned_offsets, typed_view
from atom_core.spec_decode.draft_loop import CatchUp, run_drafts
from atom_core.spec_decode.proposer import CaptureGraphs


def padded_catch_up(tokens_of: list[list[int]], counts: list[int], first_rows: list[int], q: int):
    """Request r's n = counts[r] rows (tokens tokens_of[r], hidden rows first_rows[r]..+n) padded
    to q: (token ids [R*q], hidden row per padded row [R*q], each request's last real row)."""
    ids, rows, last_rows = [], [], []
    for r, (toks, n, first) in enumerate(zip(tokens_of, counts, first_rows)):
        assert 1 <= n <= q and len(toks) == n, "a padded catch-up request has 1..q rows"
        ids.extend([*toks, *[0] * (q - n)])
        rows.extend([*range(first, first + n), *[first + n - 1] * (q - n)])
        last_rows.append(r * q + n - 1)
    return ids, rows, last_rows


class _Staging:
    """The graphs' per-step inputs in one device buffer at fixed offsets (what the graphs read),
    filled from one pinned host buffer by ONE copy a replay: the step's arrays are written into the
    host buffer in place, padding requests included, and the copy covers the prefix the replayed
    size reads (the block tables come last, so a small batch copies a few rows of them).
    The host buffer is rewritten only after the previous replay's drafts were read (a host sync),
    so its earlier copy has finished."""

    def __init__(self, max_bs: int, q: int, num_later: int, max_blocks: int, block_size: int,
                 device: torch.device):
        tokens = max_bs * q
        later = max(num_later, 1)
        self.fields = {"ids": ((tokens,), np.int64), "positions": ((tokens,), np.int64),
                       "slot_mapping": ((tokens,), np.int64), "rows": ((tokens,), np.int64),
                       "last": ((max_bs,), np.int64), "later_positions": ((later, max_bs), np.int64),
                       "later_slots": ((later, max_bs), np.int64), "later_seq_lens": ((later, max_bs), np.int32),
                       "seq_lens": ((max_bs,), np.int32), "later_qsl": ((max_bs + 1,), np.int32),
                       "mask": ((max_bs,), np.bool_), "block_tables": ((max_bs, max_blocks), np.int32)}
        self.offsets, total = aligned_offsets({name: int(np.prod(shape)) * np.dtype(dtype).itemsize
                                               for name, (shape, dtype) in self.fields.items()})
        self.host_bytes = torch.zeros(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.device_bytes = torch.zeros(total, dtype=torch.uint8, device=device)
        views = lambda buf: {name: typed_view(buf, self.offsets[name], dtype, shape)  # noqa: E731
                             for name, (shape, dtype) in self.fields.items()}
        self.host = {name: view.numpy() for name, view in views(self.host_bytes).items()}
        self.dev = views(self.device_bytes)
        self.q, self.max_blocks, self.num_later, self.block_size = q, max_blocks, num_later, block_size
        self._pad(0, max_bs)
        self.device_bytes.copy_(self.host_bytes)

    def _pad(self, start: int, end: int) -> None:
        """Requests start..end are padding: token 0 at position 0, no KV stored, row 0 read, masked."""
        h, q = self.host, self.q
        for name in ("ids", "positions", "rows"):
            h[name][start * q:end * q] = 0
        h["slot_mapping"][start * q:end * q] = -1
        h["seq_lens"][start:end] = q
        h["last"][start:end] = 0
        h["mask"][start:end] = False
        h["block_tables"][start:end] = 0
        h["later_positions"][:, start:end] = np.arange(h["later_positions"].shape[0])[:, None]
        h["later_slots"][:, start:end] = -1
        h["later_seq_lens"][:, start:end] = h["later_positions"][:, start:end] + 1
        h["later_qsl"][:] = np.arange(h["later_qsl"].shape[0])

    def stage(self, step: "PaddedStep", padded: int) -> None:
        """A padded catch-up of q rows a request (and its later drafts) laid out with a few numpy
        operations over [requests, q] straight into the host buffer, requests up to `padded`
        padding; then one copy to the device. The host work before a replay is this and the
        per-request lists of PaddedStep: no per-row Python, no intermediate arrays of a layout."""
        h, q, num, block_size = self.host, self.q, len(step.counts), self.block_size
        n = num * q
        counts, starts = np.asarray(step.counts, dtype=np.int64), np.asarray(step.starts, dtype=np.int64)
        tables = h["block_tables"][:num]
        for r, table in enumerate(step.tables):
            assert len(table) <= self.max_blocks, "a draft table past the graphs' span"
            tables[r, :len(table)] = table
            tables[r, len(table):] = 0
        j = np.arange(q, dtype=np.int64)
        real = j[None, :] < counts[:, None]  # [R, q]
        positions = starts[:, None] + j[None, :]
        h["positions"][:n] = positions.reshape(-1)
        # padding rows look up a real position's block (they store nothing: slot -1)
        lookup = np.minimum(positions, (starts + counts - 1)[:, None])
        request = np.arange(num)[:, None]
        blocks = tables[request, lookup // block_size].astype(np.int64)
        h["slot_mapping"][:n] = np.where(real, blocks * block_size + lookup % block_size, -1).reshape(-1)
        h["rows"][:n] = (np.asarray(step.first_rows, dtype=np.int64)[:, None]
                         + np.minimum(j[None, :], (counts - 1)[:, None])).reshape(-1)
        ids = h["ids"][:n].reshape(num, q)
        ids[:] = 0
        ids[real] = step.ids  # row-major: each request's tokens in order
        h["seq_lens"][:num] = starts + q
        h["last"][:num] = np.arange(num) * q + counts - 1
        mask = h["mask"][:num]
        mask[:] = False
        mask[step.entries] = True
        num_later = self.num_later
        if num_later:  # later draft j (0-based) at last + 1 + j; masked requests at position j, no KV
            base = np.where(mask, starts + counts - 1, -1)
            later = base[None, :] + np.arange(1, num_later + 1, dtype=np.int64)[:, None]  # [K-1, R]
            h["later_positions"][:, :num] = later
            later_blocks = tables[request.T, later // block_size].astype(np.int64)
            h["later_slots"][:, :num] = np.where(mask[None, :], later_blocks * block_size + later % block_size, -1)
            h["later_seq_lens"][:, :num] = later + 1
        if padded > num:
            self._pad(num, padded)
        end = self.offsets["block_tables"] + padded * self.max_blocks * 4
        self.device_bytes[:end].copy_(self.host_bytes[:end], non_blocking=True)


@dataclasses.dataclass
class PaddedStep:
    """A graph step's per-request inputs, as MTPProposer.propose collects them: request r has
    counts[r] verified rows from position starts[r] (hidden rows first_rows[r]..), over block
    table tables[r]; ids are every request's counts[r] tokens t+1, concatenated; entries: the
    requests that draft (the others run masked)."""

    counts: list[int]
    starts: list[int]
    first_rows: list[int]
    tables: list[list[int]]
    ids: list[int]
    entries: list[int]


class MTPGraphs:
    """Contract: built after the draft KV cache exists (captures at once, through `capture`:
    proposer.CaptureGraphs); `replay(...)` for `can_run(requests)`, its drafts a view valid until
    the next replay, which must come only after they were read (the staging buffer's reuse).

    previous(source, rows) -> [N, H] is the drafter's input hidden states for flat rows `rows` of
    `source`. With `source` given (EAGLE-3's aux buffer: one address for the engine's life) the
    graph gathers from it in place; without (MTP: the target's hidden states live in the step's
    own buffers) each replay first copies the rows into a buffer of the graphs'.
    The graphs read their inputs from their own staging buffer (_Staging), not the runner's: a
    replay is one host-to-device copy and the graph launch."""

    def __init__(self, layer: nn.Module, embed: nn.Module, greedy: Callable[[torch.Tensor], torch.Tensor],
                 previous: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], source: torch.Tensor | None,
                 decode_sizes: tuple[int, ...], num_drafts: int, block_size: int, span: int, device: torch.device,
                 capture: CaptureGraphs):
        q = self.query_len = 1 + num_drafts
        largest = max(decode_sizes)
        sizes = tuple(s for s in decode_sizes if s * q <= largest) or (1,)  # as the verify graphs
        tokens = max(sizes) * q
        width = embed.weight.shape[1]
        self.copies_source = source is None
        self.source = torch.zeros(tokens, width, dtype=embed.weight.dtype, device=device) if source is None else source
        self.rows = torch.arange(tokens, device=device)  # MTP: row i of the copied source is row i
        self.staging = st = _Staging(max(sizes), q, num_drafts - 1, -(-span // block_size), block_size, device)
        self.drafts = torch.zeros(max(sizes), num_drafts, dtype=torch.int64, device=device)
        d = st.dev

        def forward(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            # The runner's buffers (ids, positions, its metadata's tensors) are not read: the staging's are.
            runner_meta, n = get_attention_metadata(), ids.shape[0]
            bs = n // q
            meta = dataclasses.replace(runner_meta, seq_lens=d["seq_lens"][:bs], block_tables=d["block_tables"][:bs],
                                       slot_mapping=d["slot_mapping"][:n])
            rows = self.rows[:n] if self.copies_source else d["rows"][:n]
            later = {"later_qsl": d["later_qsl"][: bs + 1], **{name: d[name][:, :bs] for name in
                                                                 ("later_positions", "later_slots", "later_seq_lens")}}
            c = CatchUp(d["ids"][:n], d["positions"][:n], previous(self.source, rows), meta, d["last"][:bs],
                        meta.block_tables, span, later if num_drafts > 1 else None)
            self.drafts[:bs].copy_(run_drafts(layer, embed, greedy, c, num_drafts))
            return self.drafts[:bs]

        # span: draft tables reach past max_model_len into the scratch blocks (spec_decode/draft_kv.py)
        self.runner = capture(forward, sizes, span, query_len=q)

    @property
    def capture_seconds(self) -> float:
        return self.runner.capture_seconds

    def can_run(self, num_requests: int) -> bool:
        return self.runner.can_run(num_requests)

    def padded_size(self, num_requests: int) -> int:
        return self.runner.padded_size(num_requests)

    def replay(self, step: PaddedStep, hidden: torch.Tensor | None) -> torch.Tensor:
        """[requests, K] drafts of a padded catch-up of q rows a request (`step`; `hidden`: the
        step's hidden states, read when the graphs copy their source)."""
        num_requests = len(step.counts)
        padded = self.padded_size(num_requests)
        self.staging.stage(step, padded)
        n = num_requests * self.query_len
        if self.copies_source:
            self.source[:n].copy_(hidden.index_select(0, self.staging.dev["rows"][:n]))
        self.runner.replay_staged(padded)
        return self.drafts[:num_requests]
