"""Linear layers; each parameter knows how to load itself, and a quant method makes them.

A model never slices checkpoint tensors: the loader calls `param.weight_loader(param, tensor)`
(or with a shard id for packed QKV / gate-up weights), and the layer places the tensor.

Tensor parallelism: each class says which weight dim a rank holds a slice of (`tp_dim`), and
`tp_size` / `tp_rank` (default: this process's tensor-parallel group, atom_core/distributed)
pick the slice of a checkpoint tensor this layer loads. The layer hands its quant method the
per-rank sizes (the one place they are computed). A row-parallel layer sums its partial
products over the ranks (`reduce_results`), adding its bias once.
"""
from __future__ import annotations

import torch
from torch import nn

from atom_core.distributed import all_reduce, get_tp_group
from atom_core.distributed.checks import check_head_split
from atom_core.quant.base import CONVERTIBLE_DTYPES, QuantConfig, copy_weight, set_weight_attrs  # noqa: F401
from atom_core.quant.unquantized import UnquantizedLinearMethod


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    assert shard_id is None, "unsharded parameter got a shard id"
    copy_weight(param.data, loaded)


class LinearBase(nn.Module):
    """y = x W^T (+ b) with W made by the layer's quant method (see quant/).

    tp_dim: the weight dim a rank holds a slice of (0: output, 1: input, None: replicated).
    `output_sizes` lists the packed outputs (one entry for a plain linear).
    """

    tp_dim: int | None = None
    lora = None  # model_ops/lora.py's LoRALinear when adapters are on (worker/lora_slots.py attaches it)

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 quant_config: QuantConfig | None = None, prefix: str = "", tp_size: int | None = None,
                 tp_rank: int | None = None, params_dtype: torch.dtype | None = None):
        super().__init__()
        self.prefix = prefix
        if tp_size is None:
            group = get_tp_group()
            tp_size, tp_rank = group.world_size, group.rank_in_group
        self.tp_size, self.tp_rank = tp_size, tp_rank or 0
        if self.tp_dim == 1 and input_size % tp_size:
            raise ValueError(f"{prefix}: input size {input_size} does not split over {tp_size} tensor-parallel ranks")
        if self.tp_dim == 0 and any(s % tp_size for s in output_sizes):
            raise ValueError(f"{prefix}: output sizes {output_sizes} do not split over {tp_size} tensor-parallel ranks")
        self.input_size = input_size // tp_size if self.tp_dim == 1 else input_size
        self.output_sizes = [s // tp_size for s in output_sizes] if self.tp_dim == 0 else list(output_sizes)
        method = quant_config.get_quant_method(self, prefix) if quant_config is not None else None
        self.quant_method = method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, input_size=self.input_size, output_sizes=self.output_sizes,
                                         weight_loader=self.weight_loader, params_dtype=params_dtype)
        if bias:
            self.bias = nn.Parameter(torch.empty(sum(self.output_sizes), dtype=params_dtype), requires_grad=False)
            set_weight_attrs(self.bias, weight_loader=self.weight_loader, output_dim=0)
        else:
            self.register_parameter("bias", None)
        if self.shard_ids:  # the loader checks every packed shard arrived
            for param in self.parameters(recurse=False):
                if getattr(param, "output_dim", None) is not None:
                    param.expected_shards = frozenset((s, None) for s in self.shard_ids)

    @property
    def shard_ids(self) -> tuple:
        """The shard ids a packed layer loads its weight from (none for a plain linear)."""
        return ()

    def _rank_slice(self, param: nn.Parameter, loaded: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole checkpoint tensor (a row-parallel bias is not split)."""
        if self.tp_dim is None or self.tp_size == 1:
            return loaded
        dim = getattr(param, "output_dim" if self.tp_dim == 0 else "input_dim", None)
        if dim is None:
            return loaded
        size = param.shape[dim]
        return loaded.narrow(dim, self.tp_rank * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            copy_weight(param.data, self._rank_slice(param, loaded))
            return
        dim = getattr(param, "output_dim", None)
        assert dim is not None, f"{self.prefix}: a packed shard needs a parameter with an output dim"
        offset, size, start = self._shard_range(shard_id, loaded.shape[dim])
        copy_weight(param.data.narrow(dim, offset, size), loaded.narrow(dim, start, size))

    def _shard_range(self, shard_id, loaded_rows: int) -> tuple[int, int, int]:
        """(offset in the parameter, rows, first row in the checkpoint tensor) of a packed shard."""
        raise ValueError(f"{type(self).__name__} {self.prefix!r} has no packed shards (got shard {shard_id!r})")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x, self.bias)
        return out if self.lora is None else self.lora.add(x, out)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False, **kwargs):
        super().__init__(input_size, [output_size], bias, **kwargs)


class ColumnParallelLinear(LinearBase):
    tp_dim = 0

    def __init__(self, input_size: int, output_size: int, bias: bool = False, **kwargs):
        super().__init__(input_size, [output_size], bias, **kwargs)


class RowParallelLinear(LinearBase):
    """Input dim split; each rank's partial product is summed over the ranks (reduce_results
    False leaves the partial sum, bias included on rank 0 only, for the caller to reduce)."""

    tp_dim = 1

    def __init__(self, input_size: int, output_size: int, bias: bool = False, reduce_results: bool = True,
                 **kwargs):
        super().__init__(input_size, [output_size], bias, **kwargs)
        self.reduce_results = reduce_results

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(x)
        out = self.quant_method.apply(self, x, self.bias if self.tp_rank == 0 else None)
        if self.lora is not None:  # this rank's A columns: its part of the adapter product, summed below
            out = self.lora.add(x, out)
        return all_reduce(out) if self.reduce_results else out


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel outputs in one weight (e.g. gate_proj + up_proj, shards 0 and 1)."""

    tp_dim = 0

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, **kwargs):
        super().__init__(input_size, output_sizes, bias, **kwargs)

    @property
    def shard_ids(self) -> tuple:
        return tuple(range(len(self.output_sizes)))

    def _shard_range(self, shard_id: int, loaded_rows: int) -> tuple[int, int, int]:
        size = self.output_sizes[shard_id]
        return sum(self.output_sizes[:shard_id]), size, self.tp_rank * size


class QKVParallelLinear(LinearBase):
    """q, k and v projections in one weight (shards "q", "k", "v"); kv heads replicate when
    tp_size > num_kv_heads."""

    tp_dim = 0

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 **kwargs):
        tp_size = kwargs.get("tp_size") or get_tp_group().world_size
        check_head_split(num_heads, num_kv_heads, tp_size)
        self.head_dim = head_dim
        local_heads, local_kv_heads = num_heads // tp_size, max(1, num_kv_heads // tp_size)
        sizes = [h * tp_size * head_dim for h in (local_heads, local_kv_heads, local_kv_heads)]
        super().__init__(hidden_size, sizes, bias, **kwargs)
        self.num_heads, self.num_kv_heads = local_heads, local_kv_heads

    @property
    def shard_ids(self) -> tuple:
        return ("q", "k", "v")

    def _shard_range(self, shard_id: str, loaded_rows: int) -> tuple[int, int, int]:
        index = {"q": 0, "k": 1, "v": 2}[shard_id]
        size = self.output_sizes[index]
        if shard_id == "q":
            start = self.tp_rank * size
        else:  # with tp > total kv heads, consecutive ranks share (replicate) one kv head
            total_kv_heads = loaded_rows // self.head_dim
            start = self.tp_rank // max(1, self.tp_size // total_kv_heads) * size
        return sum(self.output_sizes[:index]), size, start
