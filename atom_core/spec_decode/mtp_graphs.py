"""CUDA graphs for the MTP layer's forwards.

Run eagerly, the nextn layer (a whole decoder block plus its head) costs more than the whole
model's graph-replayed decode step: its time is the launch overhead of a few dozen small kernels
(measured on DeepSeek-V2-Lite: see docs/PERFORMANCE.md). Two forwards
a step replay graphs here:

  catch-up: after a decode or verify step every request has 1 <= n <= q = 1 + K verified rows. They
    run padded to q rows a request, as the target's padded verify batches (worker/verify_batch.py):
    padding rows take token 0, the hidden state of the request's last real row and slot -1 (no
    KV stored); seq_len is first + q, so the causal rows line up and real rows attend only to
    positions that this forward or an earlier one wrote. Their outputs are never read.
  later drafts (K >= 2): one row per request, decode-shaped.

Both graphs read the previous hidden states from one persistent buffer (the forward's other
inputs go through the graph runner's own). Steps that hold a prefill chunk (more than q rows for a
request) and batches larger than the largest graph run eagerly, as before.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from atom_core.model_ops.forward_context import AttentionMetadata
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
    proposer.CaptureGraphs); `replay(runner, ...)` for `runner.can_run(requests)`; its output is a
    view valid until the next replay."""

    def __init__(self, layer: nn.Module, embed: nn.Module, decode_sizes: tuple[int, ...], q: int, span: int,
                 device: torch.device, capture: CaptureGraphs):
        largest = max(decode_sizes)
        weight = embed.weight  # [vocab rows, H]: the width of the previous hidden states the layer reads
        self.previous = torch.zeros(largest, weight.shape[1], dtype=weight.dtype, device=device)

        def forward(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return layer.forward_nextn(ids, positions, self.previous[: ids.shape[0]], embed)

        # span: draft tables reach past max_model_len into the scratch blocks (spec_decode/draft_kv.py)
        sizes = tuple(s for s in decode_sizes if s * q <= largest) or (1,)  # as the verify graphs
        self.catch_up = capture(forward, sizes, span, query_len=q)
        self.drafts = capture(forward, decode_sizes, span) if q > 2 else None

    @property
    def capture_seconds(self) -> float:
        return sum(r.capture_seconds for r in (self.catch_up, self.drafts) if r is not None)

    def replay(self, runner, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
               previous_hidden: torch.Tensor) -> torch.Tensor:
        self.previous[: ids.shape[0]].copy_(previous_hidden)
        return runner.replay(_Step(ids.shape[0], ids, positions, meta))
