"""A small draft model of the same tokenizer proposes k tokens greedily (a point-mass proposal,
which the rejection sampler verifies exactly at any temperature).

Its KV lives in its own cache, indexed by the target's block tables (same block ids, same
block size), so the scheduler allocates and frees for both. Positions the target has computed
(< known length - 1) sit in the request's real blocks; the pending token and the drafts beyond
it may fall in blocks not allocated yet, so each request also owns two scratch blocks past the
shared ones. Each step the draft catches up from its last position in a real block to the
pending token (a prompt is one prefill), then runs k - 1 single-token steps.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from atom_core.model_ops.forward_context import AttentionMetadata, set_attention_metadata
from atom_core.model_ops.kv_spec import allocate_kv_cache, attention_layers
from atom_core.spec_decode.proposer import Proposer

if TYPE_CHECKING:
    from atom_core.config import ResolvedModel, SpeculativeConfig
    from atom_core.worker.input_batch import RequestState

NUM_SCRATCH_BLOCKS = 2  # k <= 8 <= block_size draft positions span at most two new blocks


class DraftModelProposer(Proposer):
    """Contract: `allocate_kv(num_blocks)` once the target's block count is known;
    `forget(req_ids)` for requests the worker dropped; `propose` as Proposer."""

    def __init__(self, config: "SpeculativeConfig", target: "ResolvedModel", block_size: int, max_num_seqs: int):
        super().__init__(config.num_draft_tokens)
        from atom_core.loader import build_model, resolve_model_files

        files = resolve_model_files(config.draft_model)
        if files.hf_config.vocab_size != target.vocab_size:
            raise ValueError(f"draft model {config.draft_model} has vocab_size {files.hf_config.vocab_size}, the target "
                             f"{target.vocab_size}: a draft model must share the target's tokenizer")
        if block_size < self.num_draft_tokens:
            raise ValueError(f"block_size {block_size} must be >= num_speculative_tokens {self.num_draft_tokens}")
        self.model = build_model(files.hf_config, files.path, target.dtype, target.device, target.load_format,
                                 target.seed)
        self.device = target.device
        self.max_model_len = target.max_model_len
        self.block_size = block_size
        self.layers = attention_layers(self.model)
        self.free_scratch = list(range(max_num_seqs))
        self.scratch: dict[str, int] = {}  # request id -> its scratch index
        self.done: dict[str, tuple[object, int]] = {}  # request id -> (its state, draft KV computed below)
        self.first_scratch_block = 0

    def kv_layers(self) -> list:
        return self.layers

    def allocate_kv(self, num_blocks: int) -> None:
        self.first_scratch_block = num_blocks
        allocate_kv_cache(self.layers, num_blocks + NUM_SCRATCH_BLOCKS * len(self.free_scratch), self.block_size,
                          self.device)

    def forget(self, req_ids) -> None:
        for rid in req_ids:
            self.done.pop(rid, None)
            if (index := self.scratch.pop(rid, None)) is not None:
                self.free_scratch.append(index)

    def _table(self, state: "RequestState", num_tokens: int) -> list[int]:
        """Block ids for positions [0, num_tokens + k): the real blocks that hold computed
        positions (< num_tokens - 1), then the request's scratch blocks."""
        index = self.scratch[state.req_id]
        real = state.block_ids[: -(-(num_tokens - 1) // self.block_size)]
        first = self.first_scratch_block + NUM_SCRATCH_BLOCKS * index
        return real + list(range(first, first + NUM_SCRATCH_BLOCKS))

    @torch.inference_mode()
    def propose(self, states: list["RequestState"]) -> list[list[int]]:
        live = []
        for i, s in enumerate(states):
            if s.num_known_tokens + self.num_draft_tokens > self.max_model_len:
                continue
            if s.req_id not in self.scratch:
                if not self.free_scratch:  # preempted requests still hold theirs: no drafts this time
                    continue
                self.scratch[s.req_id] = self.free_scratch.pop()
            live.append(i)
        drafts: list[list[int]] = [[] for _ in states]
        if not live:
            return drafts
        rows, tables, starts, lengths = [], [], [], []
        for i in live:
            state = states[i]
            tokens = state.prompt_token_ids + state.output_token_ids
            seen, n_done = self.done.get(state.req_id, (None, 0))
            start = n_done if seen is state else 0  # a resumed request is a new state: start over
            rows.append(tokens[start:])
            starts.append(start)
            lengths.append(len(tokens))
            tables.append(self._table(state, len(tokens)))
            self.done[state.req_id] = (state, len(tokens) - 1)
        next_ids = self._forward(rows, starts, tables)
        out = [[t] for t in next_ids]
        for _ in range(self.num_draft_tokens - 1):
            starts = [start + len(r) for start, r in zip(starts, rows)]
            rows = [[d[-1]] for d in out]
            for d, t in zip(out, self._forward(rows, starts, tables)):
                d.append(t)
        for i, d in zip(live, out):
            drafts[i] = d
        return drafts

    def _forward(self, rows: list[list[int]], starts: list[int], tables: list[list[int]]) -> list[int]:
        """One flat forward of each request's rows from its start position; greedy next tokens."""
        bs = self.block_size
        ids = [t for r in rows for t in r]
        positions = [p for r, s in zip(rows, starts) for p in range(s, s + len(r))]
        slots = [table[p // bs] * bs + p % bs for r, s, table in zip(rows, starts, tables) for p in range(s, s + len(r))]
        qsl = np.cumsum([0] + [len(r) for r in rows])
        seq_lens = [s + len(r) for r, s in zip(rows, starts)]
        width = max(len(t) for t in tables)
        block_tables = np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32)
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            max_query_len=max(len(r) for r in rows),
            max_seq_len=max(seq_lens),
        )
        with set_attention_metadata(meta):
            hidden = self.model(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev))
        last = torch.tensor(qsl[1:] - 1, device=dev)
        return self.model.compute_logits(hidden[last]).argmax(dim=-1).tolist()
