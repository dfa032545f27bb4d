"""Process groups of one engine replica: which ranks share the model, on which transport.

One torch.distributed world per engine replica (its tensor-parallel ranks, over one or several
nodes). Each parallel dimension gets a `GroupCoordinator` holding two groups over the same
ranks: `device_group` for tensors the model exchanges (NCCL on GPUs, gloo on the CPU) and
`cpu_group` (always gloo) for host-side messages: the step broadcast, KV-size agreement.
Expert parallelism runs over the tensor-parallel ranks (`get_ep_group()` is that group).
Data-parallel replicas are separate worlds: they share no group (engine cores behind one API),
except when their MoE layers share experts (DP attention + EP experts, `init_replica_experts`):
then the replicas form one world, each replica one rank, whose group is the expert group.

Before `init_distributed` (and in every single-rank engine) the groups are the trivial one:
world size 1, rank 0, no process group, so every collective is an identity.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupCoordinator:
    """A parallel dimension as this rank sees it. `name` is how the compile-safe collective ops
    find the group again (an op argument must be a string, not a ProcessGroup)."""

    name: str
    ranks: tuple[int, ...]
    rank_in_group: int
    device_group: object  # torch.distributed ProcessGroup, None at world size 1
    cpu_group: object

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0


_SINGLE = GroupCoordinator("tp", (0,), 0, None, None)
_GROUPS: dict[str, GroupCoordinator] = {"tp": _SINGLE}
_EXPERT_PARALLEL = [False]
_SYMM_ALL_REDUCE: dict[str, object] = {}  # group name -> its SymmetricAllReduce (ATOM_ALL_REDUCE)


def set_expert_parallel(enabled: bool) -> None:
    """MoE layers built from now on give each rank whole experts (True) or a slice of each."""
    _EXPERT_PARALLEL[0] = enabled


def expert_parallel_enabled() -> bool:
    return _EXPERT_PARALLEL[0]


def get_tp_group() -> GroupCoordinator:
    return _GROUPS["tp"]


def get_ep_group() -> GroupCoordinator:
    """The ranks experts are split over: the tensor-parallel ranks (each has every token already),
    or the data-parallel replicas after `init_replica_experts` (each has its own tokens)."""
    return _GROUPS.get("ep", _GROUPS["tp"])


def experts_span_replicas() -> bool:
    """True after `init_replica_experts`: MoE layers must move tokens between the replicas."""
    return "ep" in _GROUPS


def get_group(name: str) -> GroupCoordinator:
    return _GROUPS[name]


def get_symmetric_all_reduce(name: str):
    """The group's symmetric-memory all-reduce, or None where its all-reduces use NCCL."""
    return _SYMM_ALL_REDUCE.get(name)


def get_tp_size() -> int:
    return get_tp_group().world_size


def get_tp_rank() -> int:
    return get_tp_group().rank_in_group


def _join_world(name: str, rank: int, world_size: int, init_method: str, device: torch.device,
                timeout_s: float) -> GroupCoordinator:
    """Join a world of `world_size` ranks; returns its coordinator, called `name`."""
    assert not dist.is_initialized(), "torch.distributed is already initialized in this process"
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    # Our own store, not init_method=tcp://: under torchrun, torch's tcp:// handler would turn
    # rank 0 into a client of torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE) and wait.
    assert init_method.startswith("tcp://"), f"expected tcp://host:port, got {init_method!r}"
    host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, int(port), world_size, is_master=rank == 0, timeout=timeout)
    dist.init_process_group(backend, store=store, world_size=world_size, rank=rank, timeout=timeout, **kwargs)
    ranks = tuple(range(world_size))
    # The default group already is the device group; the host side gets its own gloo group.
    cpu_group = dist.new_group(list(ranks), backend="gloo") if backend != "gloo" else dist.new_group(list(ranks))
    logger.info("rank %d of %d joined %s over %s", rank, world_size, init_method, backend)
    return GroupCoordinator(name, ranks, rank, dist.group.WORLD, cpu_group)


def init_distributed(rank: int, world_size: int, init_method: str, device: torch.device,
                     timeout_s: float = 600.0, all_reduce: str = "auto") -> GroupCoordinator:
    """Join the replica's world (`init_method` e.g. tcp://host:port) and build its groups.

    Every rank of the world calls this with the same world_size; all ranks form one
    tensor-parallel group. NCCL when the device is a GPU (which must be set current first),
    gloo on the CPU; the host-side group is gloo either way. all_reduce: KernelConfig.all_reduce
    (auto, nccl or symm), how the group's all-reduces run on CUDA.
    """
    from atom_core.distributed.symm_all_reduce import make_symmetric_all_reduce

    _GROUPS["tp"] = _join_world("tp", rank, world_size, init_method, device, timeout_s)
    tp = _GROUPS["tp"]
    symm = make_symmetric_all_reduce(all_reduce, tp.device_group, device, tp.cpu_group)
    if symm is not None:
        _SYMM_ALL_REDUCE["tp"] = symm
    return _GROUPS["tp"]


def adopt_tp_group(ranks: tuple[int, ...], rank_in_group: int, device_group, cpu_group) -> GroupCoordinator:
    """Make groups another runtime built this process's tensor-parallel group (plugin mode: vLLM's
    TP group, so our collectives run over the ranks and communicators vLLM set up) instead of
    joining a world of our own. At one rank the groups are dropped: every collective is an identity."""
    ranks = tuple(ranks)
    if len(ranks) == 1:
        _GROUPS["tp"] = _SINGLE
    else:
        _GROUPS["tp"] = GroupCoordinator("tp", ranks, rank_in_group, device_group, cpu_group)
    return _GROUPS["tp"]


def init_replica_experts(replica: int, num_replicas: int, init_method: str, device: torch.device,
                         timeout_s: float = 600.0) -> GroupCoordinator:
    """Join the world of data-parallel replicas whose MoE layers share experts (one rank per
    replica, no tensor parallelism inside): the tensor-parallel group stays trivial, the expert
    group is every replica, and MoE layers built from now on hold whole experts. Its cpu_group
    carries the replicas' per-step agreement (engine/lockstep.py)."""
    _GROUPS["ep"] = _join_world("ep", replica, num_replicas, init_method, device, timeout_s)
    _EXPERT_PARALLEL[0] = True
    return _GROUPS["ep"]


def destroy_distributed(timeout_s: float = 30.0) -> None:
    """Leave the world (a no-op when never joined); the groups go back to the trivial one.

    Free captured CUDA graphs first (ModelRunner.release_graphs). NCCL's teardown may wait for
    the other ranks, so every rank should leave at about the same time; it runs in a thread
    that gets `timeout_s`, after which the process goes on (and its exit frees the rest)."""
    _GROUPS["tp"] = _SINGLE
    _GROUPS.pop("ep", None)
    _SYMM_ALL_REDUCE.clear()
    _EXPERT_PARALLEL[0] = False
    if not dist.is_initialized():
        return
    leaving = threading.Thread(target=dist.destroy_process_group, name="atom-leave-groups", daemon=True)
    leaving.start()
    leaving.join(timeout_s)
    if leaving.is_alive():
        logger.warning("leaving the process groups took over %.0f s; going on without waiting", timeout_s)
