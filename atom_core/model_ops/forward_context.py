"""Per-step attention metadata, set by the model runner around each forward.

Attention layers read it instead of threading it through every model signature; the runner
sets it before the forward (or before a CUDA graph replay's capture) and clears it after.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """The flat batch's layout. Tensors live on the model's device.

    query_start_loc [S+1] int32, seq_lens [S] int32 (KV length after this step),
    block_tables [S, MB] int32, slot_mapping [T] int64 (-1 = padding, not stored).
    max_query_len / max_seq_len are host ints, upper bounds for kernel grids.
    seq_order [S] int32 (optional): the sequences longest first, the order attention programs
    start in, so the last wave holds short ones (decode batches; a schedule, not a result).
    fresh_seq_ids [F] int32 (optional, set when F > 0 in a batch with prefill rows): the sequences
    with no cached context (all their keys are this step's rows), with fresh_max_query_len; the
    others, longest first, are paged_seq_ids [S - F] with paged_max_query_len (None when F == S).
    decode_seq_ids [D] / chunk_seq_ids [C] int32 (optional, set together when the sequences with
    cached context include both kinds, whether or not any is fresh): those with q_len == 1 and
    those with q_len > 1, each longest first, with chunk_max_query_len; with fresh_seq_ids (when
    set) they list every sequence once, so attention can give decodes their own launch.
    Built on the host with the batch, so a backend can split the step without a sync.
    state_slots [S] int32 (models with linear-attention layers only): each sequence's row in the
    state pools (kv_spec.StateSpec; 0 is the padding rows' scratch). A sequence starts from a zero
    state when it has no cached context (seq_lens == its query length: a prompt's first chunk).
    state_step_rows [S] int32 (steps that verify drafts, with state_slots): each sequence's row in
    the step-state pools (the state after each of its first tokens is kept there, so a rejected
    draft's update can be dropped: kv_spec.keep_verified_states); -1 keeps none.
    state_recurrent_* / state_chunked_* (a verify step that also runs prompt chunks): the sequence
    indices (int64), their tokens' rows (int64) and cu_seqlens (int32) of the sequences that take the
    token-by-token rule (verifies, decodes) and of the prompt chunks, which take the chunked rule.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    seq_order: torch.Tensor | None = None
    fresh_seq_ids: torch.Tensor | None = None
    fresh_max_query_len: int = 0
    paged_seq_ids: torch.Tensor | None = None
    paged_max_query_len: int = 0
    decode_seq_ids: torch.Tensor | None = None
    chunk_seq_ids: torch.Tensor | None = None
    chunk_max_query_len: int = 0
    state_slots: torch.Tensor | None = None
    state_step_rows: torch.Tensor | None = None
    state_recurrent_seqs: torch.Tensor | None = None
    state_recurrent_tokens: torch.Tensor | None = None
    state_recurrent_cu_seqlens: torch.Tensor | None = None
    state_chunked_seqs: torch.Tensor | None = None
    state_chunked_tokens: torch.Tensor | None = None
    state_chunked_cu_seqlens: torch.Tensor | None = None


_current: AttentionMetadata | None = None


def get_attention_metadata() -> AttentionMetadata:
    assert _current is not None, "attention called outside of set_attention_metadata()"
    return _current


@contextmanager
def set_attention_metadata(metadata: AttentionMetadata):
    global _current
    previous, _current = _current, metadata
    try:
        yield
    finally:
        _current = previous
