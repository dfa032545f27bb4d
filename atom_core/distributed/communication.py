"""The collectives the model ops call, over the tensor-parallel group. Each is an identity at
world size 1, so a single-rank model never touches torch.distributed.

`all_reduce` is a custom op (`atom::all_reduce`) so torch.compile sees an opaque call with a
known output shape instead of tracing into torch.distributed; under CUDA graphs an NCCL
all-reduce is captured like any kernel (the communicator exists before capture: the warm-up
and memory-profiling steps run collectives first). The other collectives run where the graph
is already split (the LM head, the MoE op), eagerly. Small all-reduces may go through symmetric
memory instead (ATOM_ALL_REDUCE, distributed/symm_all_reduce.py).
"""
from __future__ import annotations

import pickle
from collections.abc import Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist

from atom_core.distributed.parallel_state import GroupCoordinator, get_group, get_symmetric_all_reduce, get_tp_group

# torch >= 2.12 names them *_single (the *_tensor names warn); the GPU machine's 2.11 has only those.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@torch.library.custom_op("atom::all_reduce", mutates_args=())
def all_reduce_op(x: torch.Tensor, group_name: str) -> torch.Tensor:
    symm = get_symmetric_all_reduce(group_name)
    if symm is not None and symm.fits(x):
        return symm(x.contiguous())
    out = x.clone()
    dist.all_reduce(out, group=get_group(group_name).device_group)
    return out


@all_reduce_op.register_fake
def _(x, group_name):
    return torch.empty_like(x)


def all_reduce(x: torch.Tensor, group: GroupCoordinator | None = None) -> torch.Tensor:
    """Sum of `x` over the group's ranks (a new tensor; `x` itself at world size 1)."""
    group = group or get_tp_group()
    if group.world_size == 1:
        return x
    return all_reduce_op(x, group.name)


def all_gather(x: torch.Tensor, dim: int = -1, group: GroupCoordinator | None = None) -> torch.Tensor:
    """The ranks' `x` concatenated along `dim`, rank order."""
    group = group or get_tp_group()
    if group.world_size == 1:
        return x
    dim = dim % x.dim()
    w = group.world_size
    out = torch.empty((w * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_flat(out, x.contiguous(), group=group.device_group)
    if dim == 0:
        return out
    # [W * d0, ..., d, ...] -> [..., W * d, ...]
    out = out.view(w, *x.shape).movedim(0, dim)
    return out.reshape(*x.shape[:dim], w * x.shape[dim], *x.shape[dim + 1:])


def reduce_scatter(x: torch.Tensor, dim: int = 0, group: GroupCoordinator | None = None) -> torch.Tensor:
    """Sum over the ranks, then this rank's 1/world_size slice along `dim` (which must divide)."""
    group = group or get_tp_group()
    if group.world_size == 1:
        return x
    dim = dim % x.dim()
    assert x.shape[dim] % group.world_size == 0, f"dim {dim} of {tuple(x.shape)} does not split {group.world_size} ways"
    chunks = x.movedim(dim, 0).contiguous()
    out = torch.empty((chunks.shape[0] // group.world_size, *chunks.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_flat(out, chunks, group=group.device_group)
    return out.movedim(0, dim)


def all_to_all(x: torch.Tensor, group: GroupCoordinator | None = None) -> torch.Tensor:
    """x [W * n, ...]: rank r's chunk i goes to rank i, whose output chunk r it becomes."""
    group = group or get_tp_group()
    if group.world_size == 1:
        return x
    assert x.shape[0] % group.world_size == 0, f"dim 0 of {tuple(x.shape)} does not split {group.world_size} ways"
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous(), group=group.device_group)
    return out


# ---- data-parallel replicas sharing experts (DP attention + EP experts) ----------------------
# Each replica brings its own tokens to a MoE layer. Dispatch: every rank gathers every replica's
# rows, each replica's padded to the largest count, so the collective has one static size per
# forward; each rank runs its own experts on all of them (others' experts weigh zero). Combine:
# a reduce-scatter sums the ranks' partial outputs and hands each replica its own rows back.
# An all-to-all that sends a token only to the ranks owning its top-k experts moves less data only
# when the top-k experts of most tokens sit on few ranks; over 2 ranks with top-8 of 128 experts,
# almost every token needs both (all 8 on one rank: ~2 * 0.5**8 < 1%), so the volumes match and the
# all-gather needs no per-peer counts (a device-to-host sync, or a second exchange, per layer).
_AGREED_COUNTS: list[tuple[int, ...] | None] = [None]
_AGREED_GRAPH_SIZE: list[int | None] = [None]


@contextmanager
def agreed_token_counts(counts: Sequence[int], graph_size: int | None = None):
    """Within: how many tokens each replica's forward holds (replica order), as the engine cores
    agreed before the step (engine/lockstep.py), so MoE layers need not ask each other.
    graph_size: the decode graph every replica replays this step, padded to it (counts are then
    all graph_size); None: the replicas run eagerly."""
    previous = _AGREED_COUNTS[0], _AGREED_GRAPH_SIZE[0]
    _AGREED_COUNTS[0], _AGREED_GRAPH_SIZE[0] = tuple(int(c) for c in counts), graph_size
    try:
        yield
    finally:
        _AGREED_COUNTS[0], _AGREED_GRAPH_SIZE[0] = previous


def agreed_graph_size() -> int | None:
    """The decode graph size the replicas agreed on for the forward running now (None: eager)."""
    return _AGREED_GRAPH_SIZE[0]


def replica_token_counts(num_tokens: int, group: GroupCoordinator) -> tuple[int, ...]:
    """Each rank's token count in the forward running now: the agreed counts, or (in a forward
    nobody agreed on: memory profiling, tests) the ranks' own counts gathered over the host group."""
    counts = _AGREED_COUNTS[0]
    if counts is None:
        gathered = [torch.empty(1, dtype=torch.int64) for _ in range(group.world_size)]
        dist.all_gather(gathered, torch.tensor([num_tokens], dtype=torch.int64), group=group.cpu_group)
        counts = tuple(int(t) for t in gathered)
    assert len(counts) == group.world_size and counts[group.rank_in_group] == num_tokens, (
        f"rank {group.rank_in_group} runs {num_tokens} tokens; the replicas agreed on {counts}")
    return counts


def dispatch_tokens(x: torch.Tensor, counts: Sequence[int], group: GroupCoordinator) -> torch.Tensor:
    """x [counts[rank], ...] -> every rank's rows [W * max(counts), ...]: rank r's at r * max(counts),
    zero rows after them up to the next rank's."""
    if group.world_size == 1:
        return x
    pad = max(counts) - x.shape[0]
    if pad:
        x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
    return all_gather(x, dim=0, group=group)


def combine_tokens(y: torch.Tensor, counts: Sequence[int], group: GroupCoordinator) -> torch.Tensor:
    """y [W * max(counts), ...], this rank's partial results for every rank's rows (as dispatched)
    -> the sum over the ranks of this rank's own rows [counts[rank], ...]."""
    if group.world_size == 1:
        return y
    return reduce_scatter(y, dim=0, group=group)[: counts[group.rank_in_group]]


def all_reduce_min_host(value: int, group: GroupCoordinator | None = None) -> int:
    """The smallest of an integer the ranks computed on their own (e.g. KV blocks that fit)."""
    group = group or get_tp_group()
    if group.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group.cpu_group)
    return int(t.item())


class MessageBroadcaster:
    """Rank 0 sends one picklable message per call, every other rank of the group receives it,
    over the host (gloo) group: one broadcast of a fixed-size buffer (length header + payload),
    a second one only for a payload larger than the buffer. Contract: every rank calls
    `broadcast` the same number of times, in the same order; rank 0 passes the message."""

    def __init__(self, group: GroupCoordinator, capacity: int = 1 << 16):
        self.group = group
        self.src = group.ranks[0]
        self.buffer = torch.zeros(capacity, dtype=torch.uint8)

    def broadcast(self, message=None):
        capacity = self.buffer.numel() - 8
        if self.group.is_first_rank:
            payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
            size = len(payload)
            self.buffer[:8] = torch.frombuffer(bytearray(size.to_bytes(8, "little")), dtype=torch.uint8)
            head = payload[:capacity]
            self.buffer[8 : 8 + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        dist.broadcast(self.buffer, src=self.src, group=self.group.cpu_group)
        size = int.from_bytes(bytes(self.buffer[:8].tolist()), "little")
        if size > capacity:  # rare: a step with many long new prompts
            rest = torch.empty(size - capacity, dtype=torch.uint8)
            if self.group.is_first_rank:
                rest.copy_(torch.frombuffer(bytearray(payload[capacity:]), dtype=torch.uint8))
            dist.broadcast(rest, src=self.src, group=self.group.cpu_group)
            if self.group.is_first_rank:
                return message
            return pickle.loads(self.buffer[8:].numpy().tobytes() + rest.numpy().tobytes())
        if self.group.is_first_rank:
            return message
        return pickle.loads(self.buffer[8 : 8 + size].numpy().tobytes())
