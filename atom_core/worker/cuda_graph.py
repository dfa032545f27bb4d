"""CUDA graphs for decode-only batches.

One graph per capture size, all sharing one memory pool and one set of persistent input
buffers sized for the largest. A batch of B decode tokens replays the graph of the smallest
captured size >= B: the real rows are copied into the buffers, padded rows point at slot -1
(their KV is never stored) and read one cached token (their output is ignored). Attention
inside a graph sizes its grid from max_model_len, so any context length replays correctly.

Speculative decoding verifies 1 + k tokens per request: a runner built with query_len = 1 + k
captures batches of that many tokens per request (sizes count requests; a graph of bs requests
runs bs * query_len tokens, and query_start_loc steps by query_len).
"""
from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from typing import TYPE_CHECKING, Callable, ContextManager

import torch

from atom_core.model_ops.forward_context import AttentionMetadata, set_attention_metadata
from atom_core.worker.graph_sizes import CapturedSizes

if TYPE_CHECKING:
    from atom_core.worker.batch_builder import FlatBatch

logger = logging.getLogger(__name__)


class CUDAGraphRunner(CapturedSizes):
    """Captures `forward(input_ids, positions) -> hidden` for each decode batch size; replays
    with padding. `profiler` (optional) records each capture.

    Contract: `capture_all()` once after the KV cache exists; `replay(flat)` only for
    decode-only batches with `can_run(len)`; returns hidden states [B, hidden] (a view of a
    persistent buffer, valid until the next replay).
    """

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], sizes: tuple[int, ...],
                 max_model_len: int, block_size: int, device: torch.device, profiler=None, query_len: int = 1,
                 capture_context: Callable[[int], ContextManager] | None = None):
        """capture_context(tokens): entered around each size's warm-up and capture (data-parallel
        replicas sharing experts: the token counts their MoE collectives are captured with)."""
        self.forward = forward
        self.capture_context = capture_context or (lambda tokens: nullcontext())
        self.profiler = profiler
        self.max_model_len = max_model_len
        self.query_len = q = query_len
        self.sizes = tuple(sorted(sizes))
        self.max_bs = self.sizes[-1]
        max_blocks = (max_model_len + block_size - 1) // block_size
        self.input_ids = torch.zeros(self.max_bs * q, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_bs * q, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((self.max_bs * q,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.full((self.max_bs,), q, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(self.max_bs + 1, dtype=torch.int32, device=device) * q
        self.block_tables = torch.zeros(self.max_bs, max_blocks, dtype=torch.int32, device=device)
        self.row_ids = torch.arange(self.max_bs, dtype=torch.int32, device=device)
        self.seq_order = self.row_ids.clone()  # padding rows keep their own index, last
        # Linear-attention models' state rows (model_ops/kv_spec.py): padding rows use row 0, the scratch.
        self.state_slots = torch.zeros(self.max_bs, dtype=torch.int32, device=device)
        # Verify graphs (q > 1) keep per-token states in each sequence's step row (padding: row 0).
        self.state_step_rows = torch.zeros(self.max_bs, dtype=torch.int32, device=device) if q > 1 else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.capture_seconds = 0.0

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            slot_mapping=self.slot_mapping[: bs * self.query_len],
            max_query_len=self.query_len,
            max_seq_len=self.max_model_len,
            seq_order=self.seq_order[:bs],
            state_slots=self.state_slots[:bs],
            state_step_rows=None if self.state_step_rows is None else self.state_step_rows[:bs],
        )

    @torch.inference_mode()
    def capture_all(self) -> None:
        start = time.perf_counter()
        model, profiler = self.forward, self.profiler
        for bs in reversed(self.sizes):  # largest first: later graphs reuse its pool memory
            meta = self._metadata(bs)
            tokens = bs * self.query_len
            with set_attention_metadata(meta), self.capture_context(tokens):
                model(self.input_ids[:tokens], self.positions[:tokens])  # warm-up (compiles, autotunes)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()

                def capture(graph=graph, bs=bs, tokens=tokens):
                    with torch.cuda.graph(graph, pool=self.pool):
                        self.outputs[bs] = model(self.input_ids[:tokens], self.positions[:tokens])

                if profiler is not None:
                    profiler.record_graph_capture(bs, capture)
                else:
                    capture()
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d CUDA graphs (bs %d..%d, %d tokens each) in %.1f s", len(self.sizes), self.sizes[0],
                    self.max_bs, self.query_len, self.capture_seconds)

    def replay(self, flat: "FlatBatch", inputs_only: bool = False, size: int | None = None) -> torch.Tensor:
        """inputs_only: keep the block tables and padding of the previous replay (same batch).
        size: replay this captured size (>= the batch; replicas sharing experts agree on one),
        not the smallest that fits."""
        q = self.query_len
        tokens = flat.num_tokens
        bs = tokens // q
        padded = size if size is not None else self.padded_size(bs)
        assert padded in self.graphs and padded >= bs, f"no captured graph of {padded} for a batch of {bs}"
        meta = flat.attn
        self.input_ids[:tokens].copy_(flat.input_ids, non_blocking=True)
        self.positions[:tokens].copy_(flat.positions, non_blocking=True)
        self.slot_mapping[:tokens].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:bs].copy_(meta.seq_lens, non_blocking=True)
        if not inputs_only:
            if meta.seq_order is not None:
                self.seq_order[:bs].copy_(meta.seq_order, non_blocking=True)
            else:
                self.seq_order[:bs].copy_(self.row_ids[:bs], non_blocking=True)
            width = meta.block_tables.shape[1]
            self.block_tables[:bs, :width].copy_(meta.block_tables, non_blocking=True)
            if meta.state_slots is not None:
                self.state_slots[:bs].copy_(meta.state_slots, non_blocking=True)
            if meta.state_step_rows is not None and self.state_step_rows is not None:
                self.state_step_rows[:bs].copy_(meta.state_step_rows, non_blocking=True)
            if padded > bs:
                self.state_slots[bs:padded].fill_(0)
                if self.state_step_rows is not None:
                    self.state_step_rows[bs:padded].fill_(0)
                self.seq_order[bs:padded].copy_(self.row_ids[bs:padded], non_blocking=True)
                self.slot_mapping[tokens : padded * q].fill_(-1)
                self.seq_lens[bs:padded].fill_(q)
        self.graphs[padded].replay()
        return self.outputs[padded][:tokens]

    def replay_staged(self, size: int) -> None:
        """Replay the graph of `size` as it is: for a forward that reads inputs staged in buffers of
        its own (spec_decode/mtp_graphs.py), not this runner's."""
        assert size in self.graphs, f"no captured graph of {size}"
        self.graphs[size].replay()

    def replay_padding(self, size: int) -> None:
        """Replay the graph of `size` with padding rows only (slot -1: nothing stored; the output
        is not read): an idle replica joins the MoE collectives of a step the others replay."""
        q = self.query_len
        self.seq_order[:size].copy_(self.row_ids[:size], non_blocking=True)
        self.slot_mapping[: size * q].fill_(-1)
        self.seq_lens[:size].fill_(q)
        self.state_slots[:size].fill_(0)
        if self.state_step_rows is not None:
            self.state_step_rows[:size].fill_(0)
        self.graphs[size].replay()
