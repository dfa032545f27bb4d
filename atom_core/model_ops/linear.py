"""Linear layers written for tensor parallelism; each parameter knows how to load itself.

With tp_size 1 the sharding is the identity, but the layout (column/row split, packed QKV and
gate/up shards) is already the one TP needs, so TP slots in without touching model files.
A model never slices checkpoint tensors: it calls `param.weight_loader(param, tensor, shard)`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    assert shard_id is None, "unsharded parameter got a shard id"
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor shape {tuple(loaded.shape)} != parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


class LinearBase(nn.Module):
    """y = x W^T (+ b). tp_dim says which weight dim is split across ranks (None: replicated)."""

    tp_dim: int | None = None

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_size: int = 1, tp_rank: int = 0):
        super().__init__()
        self.tp_size, self.tp_rank = tp_size, tp_rank
        out_local = output_size // tp_size if self.tp_dim == 0 else output_size
        in_local = input_size // tp_size if self.tp_dim == 1 else input_size
        self.weight = nn.Parameter(torch.empty(out_local, in_local), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def _rank_slice(self, param: nn.Parameter, loaded: torch.Tensor) -> torch.Tensor:
        if self.tp_dim is None or self.tp_size == 1:
            return loaded
        dim = self.tp_dim if loaded.dim() > 1 else 0  # a column-parallel bias splits on dim 0
        size = param.shape[dim]
        return loaded.narrow(dim, self.tp_rank * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param is self.bias and self.tp_dim == 1:
            default_weight_loader(param, loaded)  # row-parallel bias is added once, after reduce
            return
        default_weight_loader(param, self._rank_slice(param, loaded))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    tp_dim = None


class ColumnParallelLinear(LinearBase):
    tp_dim = 0


class RowParallelLinear(LinearBase):
    """Input dim split; with tp > 1 the partial outputs are all-reduced (distributed/)."""

    tp_dim = 1


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one weight (e.g. gate_proj + up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, **tp):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, **tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        assert shard_id is not None, "merged linear needs a shard id"
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        shard = loaded.narrow(0, self.tp_rank * size, size)
        default_weight_loader_into(param.data.narrow(0, offset, size), shard)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one weight; kv heads replicate when tp > num_kv_heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False, **tp):
        tp_size = tp.get("tp_size", 1)
        self.head_dim = head_dim
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        output = (num_heads + 2 * self.num_kv_heads * tp_size) * head_dim
        super().__init__(hidden_size, output, bias, **tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        if shard_id == "q":
            start = self.tp_rank * size
        else:  # with tp > total kv heads, consecutive ranks share (replicate) one kv head
            total_kv_heads = loaded.shape[0] // self.head_dim
            start = self.tp_rank // max(1, self.tp_size // total_kv_heads) * size
        shard = loaded.narrow(0, start, size)
        default_weight_loader_into(param.data.narrow(0, offset, size), shard)


def default_weight_loader_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint shard shape {tuple(src.shape)} != parameter slice {tuple(dst.shape)}")
    dst.copy_(src)
