"""Batched LoRA: the per-token adapter layout of a step and the torch references of the shrink and
expand kernels (kernels/triton/lora.py has their Triton twins, same signatures).

A step's tokens each run with the adapter in their slot (-1: none). With x [T, K] the layer's input,
the slot tables lora_a [L, N, K] (one adapter's A matrices stacked along N: one [R, K] per slice of a
merged layer) and lora_b [L, NO, R] (B of each slice in that slice's output rows, the scaling folded
in), a layer adds, per token t in slot s:
  v[t] = x[t] A[s]^T                       (shrink, float32 [S, T, N]: S partial sums over slices of
                                            K, v the sum over dim 0; rows of no adapter undefined)
  y[t, o_i:o_(i+1)] += v[t, iR:(i+1)R] B[s, o_i:o_(i+1)]^T   for each output slice i (expand)
Tokens of no adapter are not touched. Ranks below R are zero-padded in the tables. The references
return one partial (S = 1); the Triton shrink as many as it splits K into.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class LoRAMeta(NamedTuple):
    """The step's layout, sliced to its T rows. token_slots [T] int32 (-1: no adapter);
    sorted_token_ids [T] int32: rows grouped by slot (slot 0's first); slot_num_tokens [L] and
    slot_start [L] int32: each slot's count and first index in sorted_token_ids."""

    token_slots: torch.Tensor
    sorted_token_ids: torch.Tensor
    slot_num_tokens: torch.Tensor
    slot_start: torch.Tensor


def lora_layout(token_slots: torch.Tensor, num_slots: int) -> LoRAMeta:
    """The grouped layout of per-token slots, on their device without a host sync (the runner
    copies it into persistent buffers that CUDA graphs read)."""
    key = torch.where(token_slots < 0, num_slots, token_slots).to(torch.int64)
    order = torch.argsort(key, stable=True).to(torch.int32)
    counts = torch.zeros(num_slots + 1, dtype=torch.int32, device=token_slots.device)
    counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    starts = torch.cumsum(counts, 0, dtype=torch.int32) - counts
    return LoRAMeta(token_slots.to(torch.int32), order, counts[:num_slots], starts[:num_slots])


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, meta: LoRAMeta) -> torch.Tensor:
    """v [1, T, N] float32 = x A[slot]^T per token (zero rows for tokens of no adapter)."""
    v = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    for slot in range(lora_a.shape[0]):
        rows = (meta.token_slots == slot).nonzero().squeeze(1)
        if rows.numel():
            v[rows] = x[rows].float() @ lora_a[slot].float().T
    return v[None]


def lora_expand(y: torch.Tensor, v: torch.Tensor, lora_b: torch.Tensor, meta: LoRAMeta,
                slice_offsets: tuple[int, ...], rank: int) -> None:
    """In place: y[t, o_i:o_(i+1)] += v[t, i*rank:(i+1)*rank] B[slot, o_i:o_(i+1)]^T per token with a slot.
    slice_offsets: the output slices' boundaries (len = slices + 1, last = y's width)."""
    v = v.sum(0)
    for slot in range(lora_b.shape[0]):
        rows = (meta.token_slots == slot).nonzero().squeeze(1)
        if not rows.numel():
            continue
        for i, (lo, hi) in enumerate(zip(slice_offsets[:-1], slice_offsets[1:])):
            delta = v[rows, i * rank:(i + 1) * rank] @ lora_b[slot, lo:hi].float().T
            y[rows, lo:hi] = (y[rows, lo:hi].float() + delta).to(y.dtype)
