"""All-reduce through PyTorch symmetric memory (one-shot / two-shot), for the small all-reduces of decode.

NCCL's all-reduce inside a CUDA graph has a latency floor even for one token's 8 KB on NVLinked
GPUs: a protocol built for bandwidth. Tensor-parallel decode
runs two all-reduces per layer (Llama-3-8B: 65 a step), so at batch 1 that latency is a large
share of the step. Symmetric memory maps every rank's copy of one buffer into each GPU's address
space (peer-to-peer, no multicast). The two-shot kernel has each rank sum its slice of all
ranks' rows and write it to every rank (reduce-scatter then all-gather, one kernel): one kernel,
no protocol, so it is faster than NCCL from one token up to 8,192 x 4,096 (one-shot, every rank
summing all rows, sits between the two; measured: see docs/PERFORMANCE.md). Each rank's input is copied into
its copy of the buffer first (a copy kernel), so the gain shrinks with size: tensors up to
MAX_BYTES take this path, larger ones NCCL; up to ONE_SHOT_MAX_BYTES the one-shot kernel that
copies the input in itself runs instead (one launch, not two).

KernelConfig.all_reduce (--all-reduce, ATOM_ALL_REDUCE) picks it: `auto` (the default) where it can,
else NCCL (said in the log); `symm` always on a CUDA tensor-parallel group (an error where this build or machine cannot); `nccl` never.
Peer-to-peer memory needs every rank on one host, so a group spanning nodes keeps NCCL under auto.
Why auto is the default: the engine's path (one-shot with the copy fused in) is faster than NCCL per
decode all-reduce, and with 65 of them a step it shortens the TP=2 batch-1 step (measured: see
docs/PERFORMANCE.md); where it cannot run, NCCL is the same as without it.
"""
from __future__ import annotations

import logging
import socket
import warnings

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

MAX_BYTES = 16 << 20  # 1,024 tokens x 8,192 bf16 values: decode batches and most mixed steps
# Up to here one-shot with the copy-in fused into its kernel (one launch) instead of copy + two-shot
# (two): for small tensors the bare two-shot op is only a little faster than one-shot, less than
# the cost of its separate copy kernel (measured: see docs/PERFORMANCE.md).
ONE_SHOT_MAX_BYTES = 256 << 10


class SymmetricAllReduce:
    """Sum over a CUDA group's ranks of tensors up to `max_bytes`, through one symmetric buffer."""

    def __init__(self, device_group, device: torch.device, max_bytes: int = MAX_BYTES):
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = device_group.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)  # needed before torch 2.9, a no-op since
        if enable is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                enable(self.group_name)
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, device_group)  # collective: every rank of the group, same order
        self._two_shot_out = getattr(torch.ops.symm_mem, "two_shot_all_reduce_out", None)
        self._one_shot_copy_out = getattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out", None)

    def fits(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return x.is_cuda and nbytes <= self.buffer.numel() and nbytes % 4 == 0  # the kernel moves 4-byte words at least

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        nbytes = x.numel() * x.element_size()
        staged = self.buffer[:nbytes].view(x.dtype).view(x.shape)
        out = torch.empty_like(x)
        if nbytes <= ONE_SHOT_MAX_BYTES and self._one_shot_copy_out is not None:
            return self._one_shot_copy_out(staged, x, "sum", self.group_name, out)  # copies x in itself
        staged.copy_(x)
        if self._two_shot_out is not None:
            return self._two_shot_out(staged, "sum", self.group_name, out)
        torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.group_name)  # torch without the _out form
        return out.copy_(staged)


def ranks_share_a_host(cpu_group, host: str | None = None) -> bool:
    """Whether every rank of `cpu_group` runs on one host (`host`: this rank's name, for tests).
    A collective: every rank of the group calls it, and all get the same answer."""
    hosts: list = [None] * dist.get_world_size(cpu_group)
    dist.all_gather_object(hosts, host or socket.gethostname(), group=cpu_group)
    return len(set(hosts)) == 1


def make_symmetric_all_reduce(mode: str, device_group, device: torch.device,
                              cpu_group=None) -> SymmetricAllReduce | None:
    """The symmetric all-reduce `mode` (KernelConfig.all_reduce) asks for on this group, or None for NCCL.
    cpu_group: the group's host-side twin, to check that its ranks share a host (None: not checked)."""
    if mode == "nccl":
        return None
    if device.type != "cuda":
        if mode == "symm":
            raise ValueError(f"all_reduce=symm (--all-reduce, ATOM_ALL_REDUCE) needs CUDA ranks (this engine runs "
                             f"on {device.type}); use auto or nccl")
        return None
    if cpu_group is not None and not ranks_share_a_host(cpu_group):
        if mode == "symm":
            raise ValueError("all_reduce=symm (--all-reduce, ATOM_ALL_REDUCE) needs every tensor-parallel rank on "
                             "one host (peer-to-peer memory); this group spans nodes: use auto or nccl")
        logger.info("tensor-parallel ranks span hosts: all-reduce uses NCCL")
        return None
    try:
        return SymmetricAllReduce(device_group, device)
    except Exception as e:  # noqa: BLE001 - an unsupported build or machine raises many kinds
        if mode == "symm":
            raise RuntimeError(f"all_reduce=symm (--all-reduce, ATOM_ALL_REDUCE): symmetric memory is not usable "
                               f"here ({type(e).__name__}: {e}); use auto or nccl") from e
        logger.info("symmetric-memory all-reduce unavailable (%s: %s); all-reduce uses NCCL", type(e).__name__, e)
        return None
