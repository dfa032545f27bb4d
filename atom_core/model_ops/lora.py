"""LoRA inside the linear layers: each adapted linear holds GPU slot tables of stacked A and B and adds
y += (x A^T) B^T per token from the step's layout (kernels/lora_ref.py), so no model file changes.

`LoRABatch` holds the layout in persistent buffers sized for the largest step (like the CUDA graphs'
block tables): the runner rewrites them before every forward and every adapted linear reads them
sliced to its token count, so a captured graph replays any mix of adapters. A merged linear (q/k/v,
gate/up) gets one A per sub-projection stacked along the rank dim and each B in its sub-projection's
output rows. Under tensor parallelism the tables hold this rank's shard (worker/lora_slots.py cuts
it): column-parallel layers a slice of B's rows, row-parallel layers a slice of A's columns, whose
partial products the layer's all-reduce sums with the base product's.
"""
from __future__ import annotations

import torch

from atom_core.kernels import kernel_ops
from atom_core.kernels.lora_ref import LoRAMeta, lora_layout


@torch.library.custom_op("atom::lora_add", mutates_args=("y",))
def lora_add(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor,
             sorted_token_ids: torch.Tensor, slot_num_tokens: torch.Tensor, slot_start: torch.Tensor,
             slice_offsets: list[int], rank: int) -> None:
    """y += each token's adapter product, in place (one opaque op for torch.compile)."""
    ops = kernel_ops(x.device)
    meta = LoRAMeta(token_slots, sorted_token_ids, slot_num_tokens, slot_start)
    ops.lora_expand(y, ops.lora_shrink(x, lora_a, meta), lora_b, meta, tuple(slice_offsets), rank)


@lora_add.register_fake
def _(x, y, lora_a, lora_b, token_slots, sorted_token_ids, slot_num_tokens, slot_start, slice_offsets, rank):
    return None


class LoRABatch:
    """The step's per-token adapter slots (-1: none) and their grouped layout, in buffers of
    max_num_tokens rows. Contract: `set(token_slots)` or `clear()` before each forward (device work
    only, no host sync); `meta(T)` is what a linear of T rows reads."""

    def __init__(self, num_slots: int, max_num_tokens: int, device: torch.device):
        self.num_slots = num_slots
        self.max_num_tokens = max_num_tokens
        self.token_slots = torch.full((max_num_tokens,), -1, dtype=torch.int32, device=device)
        self.sorted_token_ids = torch.zeros(max_num_tokens, dtype=torch.int32, device=device)
        self.slot_num_tokens = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self.slot_start = torch.zeros(num_slots, dtype=torch.int32, device=device)

    def set(self, token_slots: torch.Tensor) -> None:
        num = token_slots.shape[0]
        assert num <= self.max_num_tokens, f"a step of {num} tokens exceeds the LoRA buffers' {self.max_num_tokens}"
        layout = lora_layout(token_slots, self.num_slots)
        self.token_slots[:num].copy_(layout.token_slots)
        self.token_slots[num:].fill_(-1)
        self.sorted_token_ids[:num].copy_(layout.sorted_token_ids)
        self.slot_num_tokens.copy_(layout.slot_num_tokens)
        self.slot_start.copy_(layout.slot_start)

    def clear(self) -> None:
        """No token of the step has an adapter."""
        self.token_slots.fill_(-1)
        self.slot_num_tokens.zero_()

    def meta(self, num_tokens: int) -> LoRAMeta:
        assert num_tokens <= self.max_num_tokens, f"{num_tokens} rows exceed the LoRA buffers' {self.max_num_tokens}"
        return LoRAMeta(self.token_slots[:num_tokens], self.sorted_token_ids[:num_tokens], self.slot_num_tokens,
                        self.slot_start)


class LoRALinear:
    """A linear's slot tables: lora_a [slots, slices * rank, in] and lora_b [slots, out, rank] in the
    model dtype, this rank's shard, zero where a slot's adapter does not target a sub-projection.
    slice_sizes: the layer's (per-rank) output sizes, one per sub-projection."""

    def __init__(self, batch: LoRABatch, input_size: int, slice_sizes: list[int], rank: int,
                 dtype: torch.dtype, device: torch.device):
        self.batch = batch
        self.rank = rank
        self.slice_offsets = [0]
        for size in slice_sizes:
            self.slice_offsets.append(self.slice_offsets[-1] + size)
        slots = batch.num_slots
        self.lora_a = torch.zeros(slots, len(slice_sizes) * rank, input_size, dtype=dtype, device=device)
        self.lora_b = torch.zeros(slots, self.slice_offsets[-1], rank, dtype=dtype, device=device)

    @property
    def num_slices(self) -> int:
        return len(self.slice_offsets) - 1

    def set_slot(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Put one adapter in `slot`: parts[i] = (A [r, in], B [out_i, r] with the scaling folded in)
        for sub-projection i, or None where the adapter leaves it alone. Stream-ordered copies: a step
        already launched reads the old contents."""
        assert len(parts) == self.num_slices, f"{len(parts)} parts for {self.num_slices} slices"
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for i, part in enumerate(parts):
            if part is None:
                continue
            a, b = part
            r = a.shape[0]
            lo, hi = self.slice_offsets[i], self.slice_offsets[i + 1]
            assert r <= self.rank and a.shape[1] == self.lora_a.shape[2] and b.shape == (hi - lo, r), \
                f"LoRA part A {tuple(a.shape)} / B {tuple(b.shape)} does not fit slice {lo}:{hi} of rank {self.rank}"
            self.lora_a[slot, i * self.rank:i * self.rank + r].copy_(a)
            self.lora_b[slot, lo:hi, :r].copy_(b)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base product, [..., out]) plus each token's adapter product."""
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        meta = self.batch.meta(x2.shape[0])
        lora_add(x2, y2, self.lora_a, self.lora_b, *meta, self.slice_offsets, self.rank)
        return y
