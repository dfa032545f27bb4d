"""Turns a SchedulerOutput and the worker's request states into the flat tensors one forward
needs (host side only).

All per-token arrays are built with numpy, then copied to the device in one non-blocking
transfer each from pinned memory, so building step N+1 can overlap the GPU running step N.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from atom_core.model_ops.forward_context import AttentionMetadata
from atom_core.model_ops.sampler import SamplingBatch
from atom_core.model_ops.staging import to_device_packed as _to_device_packed
from atom_core.scheduler_output import PLACEHOLDER, SchedulerOutput
from atom_core.worker.input_batch import RequestState


@dataclass
class FlatBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionMetadata
    logit_rows: torch.Tensor  # [R] rows of the hidden state to turn into logits
    sample_rows: list[int]  # index into logit_rows for each sampling sequence, batch order
    sample_seq_idx: list[int]  # which batch entries sample
    prompt_logprob_spans: list[tuple[int, int, int, int]]  # (seq idx, logit row start, first token idx, count)
    num_tokens: int
    placeholder_rows: list[int]  # flat rows whose input token is still on the GPU
    placeholder_seqs: list[int]  # the batch index of each such row's sequence
    logits_all_rows: bool = False  # every row needs logits, in order (decode): skip the gather
    verify_query_len: int = 0  # > 0: a speculative verify step padded to this many rows per request (graphs)
    mm_embeds: object = None  # models.common.MultimodalEmbeds of the step's image rows (None: none)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """One host array to the device: a non-blocking copy from pinned memory on CUDA, the array itself on the CPU."""
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


def _block_table_array(tables: list[list[int]]) -> np.ndarray:
    width = max(len(t) for t in tables)
    out = np.zeros((len(tables), width), dtype=np.int32)
    for i, table in enumerate(tables):
        out[i, : len(table)] = table
    return out


def slot_of(block_ids: list[int], position: int, block_size: int) -> int:
    """The KV cache slot of a token: the one place slot arithmetic is written on the host."""
    return block_ids[position // block_size] * block_size + position % block_size


def assemble_flat_batch(input_ids: list[int], positions: list[int], slot_mapping: list[int], query_start_loc,
                        seq_lens, block_tables: list[list[int]], max_query_len: int, logit_rows: list[int] | None,
                        device: torch.device, attn_extra: dict | None = None, **fields) -> FlatBatch:
    """The one place a step's host lists become device tensors: the AttentionMetadata and the
    FlatBatch around it. logit_rows None: every row needs logits (decode), so no gather list is
    sent. attn_extra: AttentionMetadata's optional fields (numpy arrays go to the device with the
    rest, in one copy); fields: FlatBatch's host-side ones."""
    seq_lens = np.asarray(seq_lens, dtype=np.int32)
    extra = dict(attn_extra or {})
    arrays = {name: extra.pop(name) for name in list(extra) if isinstance(extra[name], np.ndarray)}
    arrays.update(
        query_start_loc=np.asarray(query_start_loc, dtype=np.int32), seq_lens=seq_lens,
        block_tables=_block_table_array(block_tables), slot_mapping=np.array(slot_mapping, dtype=np.int64),
        logit_rows=np.array(logit_rows if logit_rows is not None else [], dtype=np.int64))
    dev = _to_device_packed(arrays, device)
    logit_rows_dev = dev.pop("logit_rows")
    attn = AttentionMetadata(max_query_len=max_query_len, max_seq_len=int(seq_lens.max()), **dev, **extra)
    return FlatBatch(  # ids and positions stay separate allocations: torch.compile guards on their storage offset
        input_ids=to_device(np.array(input_ids, dtype=np.int64), device),
        positions=to_device(np.ascontiguousarray(positions, dtype=np.int64), device),
        attn=attn,
        logit_rows=logit_rows_dev,
        num_tokens=len(input_ids),
        **fields,
    )


def context_split(query_lens: list[int], seq_lens: list[int]) -> dict:
    """AttentionMetadata's fresh/paged fields: which sequences have no cached context (every key
    is one of this step's rows) and which do, each with its longest query (none when none is
    fresh); and its decode/chunk fields: the ones with context by q_len 1 or more, when both occur.
    Id lists as host arrays: assemble_flat_batch copies them to the device with the rest."""
    fresh, paged = [], []
    for i, (q, s) in enumerate(zip(query_lens, seq_lens)):
        (fresh if q == s else paged).append(i)
    paged.sort(key=lambda i: -seq_lens[i])  # longest first, as decode batches' seq_order
    out = {}
    decodes = [i for i in paged if query_lens[i] == 1]
    if decodes and len(decodes) < len(paged):  # both kinds; two arrays: a slice of one may lose
        chunks = [i for i in paged if query_lens[i] > 1]  # the 16-byte alignment Triton specialises on
        out["decode_seq_ids"] = np.array(decodes, dtype=np.int32)
        out["chunk_seq_ids"] = np.array(chunks, dtype=np.int32)
        out["chunk_max_query_len"] = max(query_lens[i] for i in chunks)
    if not fresh:
        return out
    out["fresh_seq_ids"] = np.array(fresh, dtype=np.int32)
    out["fresh_max_query_len"] = max(query_lens[i] for i in fresh)
    if paged:
        out["paged_seq_ids"] = np.array(paged, dtype=np.int32)
        out["paged_max_query_len"] = max(query_lens[i] for i in paged)
    return out


def state_slot_rows(states: list[RequestState]) -> dict:
    """AttentionMetadata's state_slots: each sequence's row in the state pools (the engine's slot + 1;
    row 0 is the padding rows' scratch, see model_ops/kv_spec.py), for models with linear-attention
    layers."""
    return {"state_slots": np.array([s.state_slot + 1 for s in states], dtype=np.int32)}


def state_step_rows(states: list[RequestState], verifies: list[bool], query_lens: list[int] | None = None) -> dict:
    """AttentionMetadata's state_step_rows of a step that verifies drafts: a verifying sequence keeps
    the state after each of its tokens in its step-state row (its state slot's row), the others none.
    When prompt chunks share the step, the state_recurrent_* / state_chunked_* subsets split it: the
    verifying sequences and decodes take the token-by-token kernel, the prompt chunks the chunked one."""
    rows = [s.state_slot + 1 if v else -1 for s, v in zip(states, verifies)]
    out = {"state_step_rows": np.array(rows, dtype=np.int32)}
    chunked = [i for i, (v, n) in enumerate(zip(verifies, query_lens or [])) if not v and n > 1]
    if not chunked:
        return out
    starts = np.concatenate([[0], np.cumsum(query_lens)])
    recurrent = sorted(set(range(len(states))) - set(chunked))
    for name, seqs in (("recurrent", recurrent), ("chunked", chunked)):
        lens = [query_lens[i] for i in seqs]
        out[f"state_{name}_seqs"] = np.array(seqs, dtype=np.int64)
        out[f"state_{name}_tokens"] = np.concatenate(
            [np.arange(starts[i], starts[i + 1]) for i in seqs] or [np.zeros(0, np.int64)]).astype(np.int64)
        out[f"state_{name}_cu_seqlens"] = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return out


def rope_positions(state: RequestState, start: int, end: int) -> np.ndarray:
    """Rotary positions [3, end - start] of a multimodal-rotary request's tokens [start, end) (models/
    common.py: mrope_positions): its prompt's own, then index + delta."""
    table, num_prompt = state.mrope_positions, state.num_prompt_tokens
    if end <= num_prompt:
        return table[:, start:end]
    tail = np.arange(max(start, num_prompt), end, dtype=np.int64) + state.rope_delta
    if start >= num_prompt:
        return np.broadcast_to(tail, (3, end - start))
    return np.concatenate([table[:, start:], np.broadcast_to(tail, (3, len(tail)))], axis=1)


def _step_positions(positions: list[int], mrope_spans: list[tuple[int, np.ndarray]]) -> list[int] | np.ndarray:
    """The step's positions: [T] indices, with multimodal-rotary requests' rows (offset, [3, n]) written in;
    [3, T] when one of those rows has unequal axes (an image token), [T] otherwise."""
    if not mrope_spans:
        return positions
    if all((rows[0] == rows[1]).all() and (rows[0] == rows[2]).all() for _, rows in mrope_spans):
        flat = np.asarray(positions, dtype=np.int64)
        for offset, rows in mrope_spans:
            flat[offset : offset + rows.shape[1]] = rows[0]
        return flat
    full = np.broadcast_to(np.asarray(positions, dtype=np.int64), (3, len(positions))).copy()
    for offset, rows in mrope_spans:
        full[:, offset : offset + rows.shape[1]] = rows
    return full


def build_decode_batch(states: list[RequestState], block_size: int, device: torch.device,
                       with_state_slots: bool = False) -> FlatBatch:
    """The decode-only case (one new token per request, each sampling): comprehensions only. A
    multimodal-rotary request's token rotates at its index + rope_delta on all axes."""
    num = len(states)
    kv_positions = [s.num_computed_tokens for s in states]
    tokens = [s.token_at(p) for s, p in zip(states, kv_positions)]
    placeholder_rows = [i for i, token in enumerate(tokens) if token is None]
    input_ids = [-1 if t is None else t for t in tokens]
    tables = [s.block_ids for s in states]
    slots = [t[p // block_size] * block_size + p % block_size for t, p in zip(tables, kv_positions)]
    rows = list(range(num))
    seq_lens = np.array(kv_positions, dtype=np.int32) + 1
    positions = [p + s.rope_delta for s, p in zip(states, kv_positions)]
    return assemble_flat_batch(
        input_ids, positions, slots, np.arange(num + 1), seq_lens, tables, 1, None, device,
        attn_extra={"seq_order": np.argsort(-seq_lens, kind="stable").astype(np.int32),
                    **(state_slot_rows(states) if with_state_slots else {})},
        sample_rows=rows,
        sample_seq_idx=rows,
        prompt_logprob_spans=[],
        placeholder_rows=placeholder_rows,
        placeholder_seqs=placeholder_rows,
        logits_all_rows=True,
    )


def build_flat_batch(out: SchedulerOutput, states: list[RequestState], block_size: int,
                     device: torch.device, with_state_slots: bool = False) -> FlatBatch:
    """Plain Python lists per token (cheaper than many small numpy ops), one array each at the end.
    with_state_slots: the model has linear-attention layers (the metadata carries state_slots)."""
    if out.is_decode_only:
        return build_decode_batch(states, block_size, device, with_state_slots)
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    tables = [s.block_ids for s in states]
    logit_rows: list[int] = []
    sample_rows, sample_seq_idx, spans = [], [], []
    placeholder_rows: list[int] = []
    placeholder_seqs: list[int] = []
    offset = 0
    max_query_len = 0
    mrope_spans: list[tuple[int, np.ndarray]] = []  # (flat row, [3, n]) of multimodal-rotary requests
    for i, (state, n, extra) in enumerate(zip(states, out.num_scheduled_tokens, out.extra_tokens)):
        start = state.num_computed_tokens
        table = state.block_ids
        if state.mrope_positions is not None:
            mrope_spans.append((offset, rope_positions(state, start, start + n)))
        if n == 1:
            token = state.token_at(start)
            if token is None:  # still on the device: the runner fills it from the previous step's samples
                placeholder_rows.append(offset)
                placeholder_seqs.append(i)
                token = -1
            input_ids.append(token)
            positions.append(start)
            slot_mapping.append(slot_of(table, start, block_size))
        else:
            input_ids.extend(state.tokens(start, start + n))
            positions.extend(range(start, start + n))
            slot_mapping.extend(slot_of(table, p, block_size) for p in range(start, start + n))
        drafts = extra if extra and extra[0] != PLACEHOLDER else ()  # verified after the scheduled tokens
        assert not (drafts and state.mrope_positions is not None), "drafts for a multimodal-rotary request"
        if drafts:
            input_ids.extend(drafts)
            positions.extend(range(start + n, start + n + len(drafts)))
            slot_mapping.extend(slot_of(table, p, block_size) for p in range(start + n, start + n + len(drafts)))
        total = n + len(drafts)
        max_query_len = max(max_query_len, total)
        seq_lens.append(start + total)
        query_start_loc.append(offset + total)
        if state.sampling_params.prompt_logprobs is not None:
            # logits at position p score prompt token p + 1
            first = max(start + 1, state.num_prompt_logprobs)
            last = min(start + n, state.num_prompt_tokens - 1)
            if last >= first:
                spans.append((i, len(logit_rows), first, last - first + 1))
                logit_rows.extend(range(offset + first - 1 - start, offset + last - start))
                state.num_prompt_logprobs = last + 1
        if start + n >= state.num_known_tokens:  # reaches its last token: samples the next one
            sample_seq_idx.append(i)
            sample_rows.append(len(logit_rows))
            logit_rows.extend(range(offset + n - 1, offset + total))  # one more row per draft
        offset += total
    return assemble_flat_batch(
        input_ids, _step_positions(positions, mrope_spans), slot_mapping, query_start_loc, seq_lens, tables,
        max_query_len, logit_rows, device,
        attn_extra={**context_split(np.diff(query_start_loc).tolist(), seq_lens),
                    **(state_slot_rows(states) if with_state_slots else {}),
                    **(state_step_rows(states, [bool(e) and e[0] != PLACEHOLDER for e in out.extra_tokens],
                                       np.diff(query_start_loc).tolist())
                       if with_state_slots and out.has_drafts else {})},
        sample_rows=sample_rows,
        sample_seq_idx=sample_seq_idx,
        prompt_logprob_spans=spans,
        placeholder_rows=placeholder_rows,
        placeholder_seqs=placeholder_seqs,
        logits_all_rows=len(logit_rows) == offset,
    )


def build_sampling_batch(out: SchedulerOutput, states: list[RequestState], seq_idx: list[int], vocab_size: int,
                         eos_token_ids, device: torch.device, rng: random.Random) -> SamplingBatch:
    """Per-row sampling tensors for the requests that sample this step."""
    seqs = [states[i] for i in seq_idx]
    # The output index each row samples (seeded sampling's position, min_tokens' count).
    num_outputs = [out.num_computed_tokens[i] + out.num_scheduled_tokens[i] - states[i].num_prompt_tokens
                   for i in seq_idx]
    params = [s.sampling_params for s in seqs]
    temps = np.array([p.temperature if not p.is_greedy else 0.0 for p in params], dtype=np.float32)
    all_greedy = bool((temps == 0).all())
    sb = SamplingBatch(
        temperatures=to_device(temps, device), top_ks=None, top_ps=None, min_ps=None, seeds=None,
        positions=None, all_greedy=all_greedy, any_greedy=bool((temps == 0).any()),
    )
    logprob_ks = [p.logprobs for p in params if p.logprobs is not None]
    sb.max_num_logprobs = max(logprob_ks) if logprob_ks else -1
    if not all_greedy:
        if any(p.top_k > 0 for p in params):
            top_ks = [p.top_k if p.top_k > 0 else vocab_size for p in params]
            sb.top_ks = to_device(np.array(top_ks, dtype=np.int64), device)
        if any(p.top_p < 1 for p in params):
            sb.top_ps = to_device(np.array([p.top_p for p in params], dtype=np.float32), device)
        if any(p.min_p > 0 for p in params):
            sb.min_ps = to_device(np.array([p.min_p for p in params], dtype=np.float32), device)
        if any(p.seed is not None for p in params):
            seeds = [p.seed if p.seed is not None else rng.getrandbits(63) for p in params]
            sb.seeds = to_device(np.array(seeds, dtype=np.int64), device)
            sb.positions = to_device(np.array(num_outputs, dtype=np.int64), device)
    if any(p.has_penalties for p in params):
        _add_penalties(sb, seqs, vocab_size, device)
    if any(p.logit_bias for p in params):
        entries = [(r, t, b) for r, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
        rows, tokens, biases = zip(*entries)
        sb.logit_bias = (to_device(np.array([rows, tokens], dtype=np.int64), device),
                         to_device(np.array(biases, dtype=np.float32), device))
    banned = [(r, s) for r, (s, k) in enumerate(zip(seqs, num_outputs)) if k < s.sampling_params.min_tokens]
    restricted = [(r, p.allowed_token_ids) for r, p in enumerate(params) if p.allowed_token_ids is not None]
    if banned or restricted:
        mask = np.zeros((len(seqs), vocab_size), dtype=bool)
        for r, allowed in restricted:  # everything outside the allowed ids
            mask[r] = True
            mask[r, allowed] = False
        for r, s in banned:
            ids = [t for t in (*eos_token_ids, *s.sampling_params.stop_token_ids) if t < vocab_size]
            mask[r, ids] = True
        sb.banned_mask = to_device(mask, device)
    if out.grammar_req_ids:
        sb.grammar_bitmask = to_device(_grammar_rows(out, seq_idx), device)
    return sb


def _grammar_rows(out: SchedulerOutput, seq_idx: list[int]) -> np.ndarray:
    """The step's grammar bitmask laid out by sampling row; rows without a grammar allow all."""
    row_of = {rid: r for r, rid in enumerate(out.grammar_req_ids)}
    bitmask = np.full((len(seq_idx), out.grammar_bitmask.shape[1]), -1, dtype=np.int32)
    for r, i in enumerate(seq_idx):
        g = row_of.get(out.req_ids[i])
        if g is not None:
            bitmask[r] = out.grammar_bitmask[g]
    return bitmask


def _add_penalties(sb: SamplingBatch, seqs, vocab_size: int, device: torch.device) -> None:
    prompt_mask = np.zeros((len(seqs), vocab_size), dtype=bool)
    counts = np.zeros((len(seqs), vocab_size), dtype=np.float32)
    for r, s in enumerate(seqs):
        prompt_mask[r, s.prompt_token_ids] = True
        np.add.at(counts[r], np.asarray(s.output_token_ids, dtype=np.int64), 1.0)
    params = [s.sampling_params for s in seqs]
    sb.prompt_mask = to_device(prompt_mask, device)
    sb.output_counts = to_device(counts, device)
    sb.repetition_penalties = to_device(np.array([p.repetition_penalty for p in params], dtype=np.float32), device)
    sb.presence_penalties = to_device(np.array([p.presence_penalty for p in params], dtype=np.float32), device)
    sb.frequency_penalties = to_device(np.array([p.frequency_penalty for p in params], dtype=np.float32), device)
