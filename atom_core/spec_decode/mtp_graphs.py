"""CUDA graphs for a hidden-state drafter's step (the MTP layer, an EAGLE-3 head).

Run eagerly, the drafter (a whole decoder block plus its head) costs more than the whole model's
graph-replayed decode step: its time is the launch overhead of a few dozen small kernels and the
host work between them (measured on DeepSeek-V2-Lite: see docs/PERFORMANCE.md). So a step's whole
draft loop (spec_decode/draft_loop.py) replays as ONE graph: the gather of the previous hidden
states (EAGLE-3: and its fc), the catch-up forward, the greedy head of each draft and the K - 1
later drafts, their positions and KV slots advanced on the device. The host copies the step's
inputs in, replays, and reads the [requests, K] drafts once.

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

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from atom_core.model_ops.forward_context import AttentionMetadata, get_attention_metadata
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


@dataclass
class _Step:
    """What CUDAGraphRunner.replay reads of a flat batch."""
    num_tokens: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata


class MTPGraphs:
    """Contract: built after the draft KV cache exists (captures at once, through `capture`:
    proposer.CaptureGraphs); `replay(...)` for `can_run(requests)`, its drafts a view valid until
    the next replay.

    previous(source, rows) -> [N, H] is the drafter's input hidden states for flat rows `rows` of
    `source`. With `source` given (EAGLE-3's aux buffer: one address for the engine's life) the
    graph gathers from it in place; without (MTP: the target's hidden states live in the step's
    own buffers) each replay first copies the rows into a buffer of the graphs'."""

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
        self.last = torch.zeros(max(sizes), dtype=torch.int64, device=device)
        self.mask = torch.zeros(max(sizes), dtype=torch.bool, device=device)
        self.drafts = torch.zeros(max(sizes), num_drafts, dtype=torch.int64, device=device)

        def forward(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            meta, n = get_attention_metadata(), ids.shape[0]
            bs = n // q
            c = CatchUp(ids, positions, previous(self.source, self.rows[:n]), meta, self.last[:bs],
                        meta.block_tables, span, self.mask[:bs])
            self.drafts[:bs].copy_(run_drafts(layer, embed, greedy, c, num_drafts, block_size))
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

    def replay(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, rows: torch.Tensor,
               last: torch.Tensor, mask: torch.Tensor, hidden: torch.Tensor | None) -> torch.Tensor:
        """[requests, K] drafts of a padded catch-up of q rows a request. rows [N]: each row's row
        of the step's hidden states `hidden` (read when the graphs copy their source); last, mask
        [padded_size(requests)]: each request's last real row, whether it drafts (False for the
        padding requests)."""
        n = ids.shape[0]
        if self.copies_source:
            self.source[:n].copy_(hidden.index_select(0, rows))
        else:
            self.rows[:n].copy_(rows)
        self.last[: last.shape[0]].copy_(last)
        self.mask[: mask.shape[0]].copy_(mask)
        self.runner.replay(_Step(n, ids, positions, meta))
        return self.drafts[: n // self.query_len]
