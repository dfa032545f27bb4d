"""A small draft model of the same tokenizer proposes k tokens greedily (a point-mass proposal,
which the rejection sampler verifies exactly at any temperature).

Its KV lives in its own cache on the target's block tables (spec_decode/draft_kv.py). Each step
the draft catches up from its last position in a real block to the pending token (a prompt is
one prefill), then runs k - 1 single-token steps.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from atom_core.model_ops.forward_context import set_attention_metadata
from atom_core.model_ops.kv_spec import attention_layers
from atom_core.spec_decode.draft_kv import DraftKV
from atom_core.spec_decode.proposer import Proposer, RequestView

if TYPE_CHECKING:
    from atom_core.config import ResolvedModel, SpeculativeConfig


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
        self.layers = attention_layers(self.model)
        self.kv = DraftKV(self.layers, block_size, max_num_seqs, target.device)
        self.done: dict[str, tuple[object, int]] = {}  # request id -> (its state, draft KV computed below)

    def kv_layers(self) -> list:
        return self.layers

    def allocate_kv(self, num_blocks: int) -> None:
        self.kv.allocate(num_blocks)

    def forget(self, req_ids) -> None:
        for rid in req_ids:
            self.done.pop(rid, None)
        self.kv.release(req_ids)

    @torch.inference_mode()
    def propose(self, states: list[RequestView], target=None) -> list[list[int]]:
        live = []
        for i, s in enumerate(states):
            if s.num_known_tokens + self.num_draft_tokens > self.max_model_len:
                continue
            if self.kv.claim(s.req_id):  # preempted requests still hold theirs: no drafts this time
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
            tables.append(self.kv.table(state, len(tokens) - 1))
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
        positions, meta = self.kv.metadata([len(r) for r in rows], starts, tables)
        dev = self.device
        with set_attention_metadata(meta):
            hidden = self.model(torch.tensor([t for r in rows for t in r], device=dev), positions)
        last = meta.query_start_loc[1:].long() - 1
        return self.model.compute_logits(hidden[last]).argmax(dim=-1).tolist()
