"""Vocabulary embedding and LM head, split over the tensor-parallel ranks by vocabulary rows.

Rank r holds rows [r * per_rank, (r + 1) * per_rank) with per_rank = ceil(vocab / tp); the last
rank's rows past the vocabulary stay zero. The embedding looks up the ids it owns (zeros for the
others) and sums over the ranks; the head computes its rows' logits and gathers them, so every
rank ends with the whole [rows, vocab] logits (and samples the same token).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom_core.distributed import all_gather, all_reduce, get_tp_group
from atom_core.model_ops.linear import copy_weight
from atom_core.quant.unquantized import dense_linear_table, unquantized_linear


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        group = get_tp_group()
        self.vocab_size, self.tp_size = vocab_size, group.world_size
        self.rows_per_rank = -(-vocab_size // self.tp_size)
        self.vocab_start = group.rank_in_group * self.rows_per_rank
        self.num_rows = max(0, min(vocab_size - self.vocab_start, self.rows_per_rank))  # real rows here
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if self.tp_size == 1:
            copy_weight(param.data, loaded)
            return
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"checkpoint vocab rows {loaded.shape[0]} != vocab_size {self.vocab_size}")
        param.data[self.num_rows:].zero_()
        copy_weight(param.data[: self.num_rows], loaded.narrow(0, self.vocab_start, self.num_rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        owned = (local >= 0) & (local < self.num_rows)
        out = F.embedding(torch.where(owned, local, 0), self.weight)
        return all_reduce(out * owned.unsqueeze(-1).to(out.dtype))


class LMHead(VocabEmbedding):
    """logits = hidden @ W^T, computed only for the rows the runner asks for; its kernels (the decode
    GEMV at 1 token on CUDA) from a table made for the device its weight is built on. A tied head
    shares the embedding's weight, on the same device."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__(vocab_size, hidden_size)
        self.kernel_table = dense_linear_table(self.weight.device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = unquantized_linear(hidden, self.weight, None, self.kernel_table)
        if self.tp_size == 1:
            return logits
        logits = all_gather(logits, dim=-1)
        if logits.shape[-1] != self.vocab_size:  # the last rank's padding rows (kernels want unit-stride rows)
            logits = logits[:, : self.vocab_size].contiguous()
        return logits
