"""The worker's side of speculative decoding: the padded batch the verify graphs replay, per-row
sampling inputs for the rejection sampler (a request that samples owns 1 + k logit rows, k: its
drafts), and where a step's verified rows sit in its hidden states, for a proposer that drafts
from them."""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from atom_core.model_ops.sampler import SamplingBatch
from atom_core.scheduler_output import PLACEHOLDER, SchedulerOutput
from atom_core.spec_decode.proposer import TargetHidden
from atom_core.worker.batch_builder import (FlatBatch, assemble_flat_batch, build_sampling_batch, slot_of,
                                           state_slot_rows, state_step_rows, to_device)
from atom_core.worker.input_batch import RequestState


@dataclass
class VerifyRows:
    batch: SamplingBatch  # one row per logit row of a sampling request
    draft_ids: torch.Tensor  # [R] the draft each row verifies; -1 on a request's last row
    logit_rows: list[int]  # the rows of the step's logits, in order
    first_rows: list[int]  # per sampling request: its first row
    drafts: list[list[int]]  # per sampling request


def verify_rows(out: SchedulerOutput, states: list[RequestState], flat: FlatBatch, vocab_size: int,
                eos_token_ids, device: torch.device, rng: random.Random) -> VerifyRows:
    """Row j of a request sees its outputs plus drafts[:j] (penalties, min_tokens) and samples
    output index + j (seeded noise)."""
    row_states, row_computed, draft_ids, logit_rows, first_rows, drafts = [], [], [], [], [], []
    for i, first in zip(flat.sample_seq_idx, flat.sample_rows):
        state, draft = states[i], out.extra_tokens[i]
        before = out.num_computed_tokens[i] + out.num_scheduled_tokens[i] - 1  # position of row 0
        first_rows.append(len(draft_ids))
        drafts.append(list(draft))
        for j in range(len(draft) + 1):
            outputs = state.output_token_ids + list(draft[:j]) if j else state.output_token_ids
            row_states.append(RequestState(state.req_id, state.prompt_token_ids, outputs, state.sampling_params))
            row_computed.append(before + j)
            draft_ids.append(draft[j] if j < len(draft) else -1)
            logit_rows.append(first + j)
    rows_out = SchedulerOutput([s.req_id for s in row_states], [1] * len(row_states), row_computed)
    if getattr(out, "grammar_req_ids", None):  # grammar requests never draft: one row each
        rows_out.grammar_req_ids, rows_out.grammar_bitmask = out.grammar_req_ids, out.grammar_bitmask
    batch = build_sampling_batch(rows_out, row_states, list(range(len(row_states))), vocab_size, eos_token_ids,
                                 device, rng)
    return VerifyRows(batch, to_device(np.array(draft_ids, dtype=np.int64), device), logit_rows, first_rows,
                      drafts)


def build_padded_verify_batch(out: SchedulerOutput, states: list[RequestState], query_len: int, block_size: int,
                              device: torch.device, with_state_slots: bool = False) -> FlatBatch:
    """A decode step whose requests verify up to query_len - 1 drafts each, laid out as exactly
    query_len rows per request so a CUDA graph can run it: a request with fewer drafts gets
    padding rows (token 0, slot -1: no KV stored, logits not read). Every request's seq_len is
    its position + query_len, so the causal rows line up; real rows attend only to real KV.
    Linear-attention layers run the padding rows into the state too, so every request keeps its
    per-token states (with_state_slots) and the runner takes the one after its accepted tokens.
    The caller checks that each request decodes and position + query_len <= max_model_len."""
    q = query_len
    input_ids, positions, slots, logit_rows, sample_rows, seq_lens = [], [], [], [], [], []
    for i, (state, extra) in enumerate(zip(states, out.extra_tokens)):
        start, table = state.num_computed_tokens, state.block_ids
        tokens = [state.token_at(start), *extra]
        assert tokens[0] is not None, "a verify step needs its pending token on the host"
        sample_rows.append(len(logit_rows))
        for j in range(q):
            positions.append(start + j)
            if j < len(tokens):
                input_ids.append(tokens[j])
                slots.append(slot_of(table, start + j, block_size))
                logit_rows.append(i * q + j)
            else:
                input_ids.append(0)
                slots.append(-1)
        seq_lens.append(start + q)
    num = len(states)
    # padding rows may sit past a request's last block: they read block 0 there
    tables = [s.block_ids + [0] * (-(-length // block_size) - len(s.block_ids)) for s, length in zip(states, seq_lens)]
    return assemble_flat_batch(
        input_ids, positions, slots, np.arange(num + 1) * q, seq_lens, tables, q, logit_rows, device,
        sample_rows=sample_rows,
        sample_seq_idx=list(range(num)),
        prompt_logprob_spans=[],
        placeholder_rows=[],
        placeholder_seqs=[],
        verify_query_len=q,
        attn_extra={**state_slot_rows(states), **state_step_rows(states, [True] * num)} if with_state_slots else None,
    )


def target_hidden(out: SchedulerOutput, flat: FlatBatch, hidden: torch.Tensor, states: list[RequestState],
                  sampled: list[list[int]]) -> TargetHidden:
    """Where each request's verified rows sit in the step's hidden states: its scheduled tokens
    plus the drafts it accepted (the rows after them saw rejected tokens). sampled: the tokens
    each request emitted this step."""
    assert not out.is_window, "speculative decoding replaces multi-step windows"
    q = flat.verify_query_len  # a padded verify step: request i's rows start at i * q
    row_starts, num_rows, offset = [], [], 0
    for i, (n, extra, toks) in enumerate(zip(out.num_scheduled_tokens, out.extra_tokens, sampled)):
        num_drafts = len(extra) if extra and extra[0] != PLACEHOLDER else 0
        row_starts.append(i * q if q else offset)
        offset += n + num_drafts
        num_rows.append(n + max(len(toks) - 1, 0))
    return TargetHidden(hidden, states, row_starts, list(out.num_computed_tokens), num_rows)
