"""Turns a ScheduledBatch into the flat tensors one forward needs (host side only).

All per-token arrays are built with numpy, then copied to the device in one non-blocking
transfer each from pinned memory, so building step N+1 can overlap the GPU running step N.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from atom_core.engine.scheduler import ScheduledBatch
from atom_core.model_ops.forward_context import AttentionMetadata
from atom_core.model_ops.sampler import SamplingBatch


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


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


def build_flat_batch(batch: ScheduledBatch, block_size: int, device: torch.device) -> FlatBatch:
    num_seqs = len(batch)
    total = batch.total_tokens
    input_ids = np.empty(total, dtype=np.int64)
    positions = np.empty(total, dtype=np.int64)
    slot_mapping = np.empty(total, dtype=np.int64)
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int32)
    seq_lens = np.empty(num_seqs, dtype=np.int32)
    max_blocks = max(len(s.block_table) for s in batch.seqs)
    block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
    logit_rows: list[int] = []
    sample_rows, sample_seq_idx, spans = [], [], []
    offset = 0
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        start = seq.num_computed_tokens
        input_ids[offset : offset + n] = seq.token_ids[start : start + n]
        pos = np.arange(start, start + n)
        positions[offset : offset + n] = pos
        table = np.asarray(seq.block_table, dtype=np.int64)
        block_tables[i, : len(table)] = table
        slot_mapping[offset : offset + n] = table[pos // block_size] * block_size + pos % block_size
        seq_lens[i] = start + n
        query_start_loc[i + 1] = offset + n
        if seq.wants_prompt_logprobs:
            # logits at position p score prompt token p + 1
            first = max(start + 1, len(seq.prompt_logprobs))
            last = min(start + n, seq.num_prompt_tokens - 1)
            if last >= first:
                spans.append((i, len(logit_rows), first, last - first + 1))
                logit_rows.extend(range(offset + first - 1 - start, offset + last - start))
        if batch.samples(i):
            sample_seq_idx.append(i)
            sample_rows.append(len(logit_rows))
            logit_rows.append(offset + n - 1)
        offset += n
    attn = AttentionMetadata(
        query_start_loc=_to_device(query_start_loc, device),
        seq_lens=_to_device(seq_lens, device),
        block_tables=_to_device(block_tables, device),
        slot_mapping=_to_device(slot_mapping, device),
        max_query_len=max(batch.num_new_tokens),
        max_seq_len=int(seq_lens.max()),
    )
    return FlatBatch(
        input_ids=_to_device(input_ids, device),
        positions=_to_device(positions, device),
        attn=attn,
        logit_rows=_to_device(np.asarray(logit_rows, dtype=np.int64), device),
        sample_rows=sample_rows,
        sample_seq_idx=sample_seq_idx,
        prompt_logprob_spans=spans,
        num_tokens=total,
    )


def build_sampling_batch(batch: ScheduledBatch, seq_idx: list[int], vocab_size: int,
                         eos_token_ids: set[int], device: torch.device, rng: random.Random) -> SamplingBatch:
    """Per-row sampling tensors for the sequences that sample this step."""
    seqs = [batch.seqs[i] for i in seq_idx]
    params = [s.sampling_params for s in seqs]
    temps = np.array([p.temperature if not p.is_greedy else 0.0 for p in params], dtype=np.float32)
    all_greedy = bool((temps == 0).all())
    sb = SamplingBatch(
        temperatures=_to_device(temps, device), top_ks=None, top_ps=None, min_ps=None, seeds=None,
        positions=None, all_greedy=all_greedy, any_greedy=bool((temps == 0).any()),
    )
    logprob_ks = [p.logprobs for p in params if p.logprobs is not None]
    sb.max_num_logprobs = max(logprob_ks) if logprob_ks else -1
    if not all_greedy:
        if any(p.top_k > 0 for p in params):
            sb.top_ks = _to_device(np.array([p.top_k if p.top_k > 0 else vocab_size for p in params], dtype=np.int64), device)
        if any(p.top_p < 1 for p in params):
            sb.top_ps = _to_device(np.array([p.top_p for p in params], dtype=np.float32), device)
        if any(p.min_p > 0 for p in params):
            sb.min_ps = _to_device(np.array([p.min_p for p in params], dtype=np.float32), device)
        if any(p.seed is not None for p in params):
            seeds = [p.seed if p.seed is not None else rng.getrandbits(63) for p in params]
            sb.seeds = _to_device(np.array(seeds, dtype=np.int64), device)
            sb.positions = _to_device(np.array([s.num_output_tokens for s in seqs], dtype=np.int64), device)
    if any(p.has_penalties for p in params):
        _add_penalties(sb, seqs, vocab_size, device)
    banned = [(r, s) for r, s in enumerate(seqs) if s.num_output_tokens < s.sampling_params.min_tokens]
    if banned:
        mask = np.zeros((len(seqs), vocab_size), dtype=bool)
        for r, s in banned:
            ids = [t for t in (*eos_token_ids, *s.sampling_params.stop_token_ids) if t < vocab_size]
            mask[r, ids] = True
        sb.banned_mask = _to_device(mask, device)
    return sb


def _add_penalties(sb: SamplingBatch, seqs, vocab_size: int, device: torch.device) -> None:
    prompt_mask = np.zeros((len(seqs), vocab_size), dtype=bool)
    counts = np.zeros((len(seqs), vocab_size), dtype=np.float32)
    for r, s in enumerate(seqs):
        prompt_mask[r, s.prompt_token_ids] = True
        np.add.at(counts[r], np.asarray(s.output_token_ids, dtype=np.int64), 1.0)
    params = [s.sampling_params for s in seqs]
    sb.prompt_mask = _to_device(prompt_mask, device)
    sb.output_counts = _to_device(counts, device)
    sb.repetition_penalties = _to_device(np.array([p.repetition_penalty for p in params], dtype=np.float32), device)
    sb.presence_penalties = _to_device(np.array([p.presence_penalty for p in params], dtype=np.float32), device)
    sb.frequency_penalties = _to_device(np.array([p.frequency_penalty for p in params], dtype=np.float32), device)
