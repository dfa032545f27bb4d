"""Data-parallel replicas whose MoE layers share experts (DP attention + EP experts) step together.

Each replica is one engine core with its own scheduler, KV cache and requests, running attention
on its own tokens; its MoE layers hold 1/N of the experts, and every layer's tokens travel between
the replicas (distributed/communication.py: dispatch_tokens / combine_tokens). Those collectives
meet only if every replica runs the same forwards, so each step starts with an agreement (one
host all-gather over the replicas' gloo group): each replica's token count, and whether one is
stopping. Then, if any replica has tokens, every replica runs exactly one forward: its own batch,
or a dummy forward of one padding token (KV slot -1: stored nowhere) when it has none; the MoE
layers read the agreed counts to size their all-gather. If none has tokens no forward runs, and
the core loop (engine/async_engine.py: _lockstep_core_loop) waits briefly for requests before the
next agreement.

CUDA graphs (on by default; off with --enforce-eager or ep_dispatch=alltoall, where
config.py refuses graph options or turns graphs off): the agreement
also carries whether each replica's step could replay a decode graph (decode only, within the
largest captured size, or no tokens). When all could, every replica replays the graph of the
smallest captured size holding the largest batch (an idle one with padding rows only), so the
MoE all-gathers inside the graphs meet at the size they were captured with; else all run eagerly.

One rank per replica: no tensor parallelism inside, no multi-step windows or speculative
decoding (they change the number of forwards per step).
"""
from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from atom_core.config import EngineConfig
from atom_core.distributed import agreed_token_counts, destroy_distributed, init_replica_experts
from atom_core.engine.core import EngineCore
from atom_core.worker.graph_sizes import padded_size

logger = logging.getLogger(__name__)


def lockstep_graph_size(counts: list[int], graphable: list[bool], sizes: tuple[int, ...]) -> int | None:
    """The decode graph every replica replays this step, or None (all run eagerly): each replica's
    step must be graphable (decode only within the captured sizes, or no tokens), one must have
    tokens, and `sizes` (sorted) must hold the largest batch."""
    if not sizes or not all(graphable) or not any(counts):
        return None
    return padded_size(sizes, max(counts))


class ReplicaLostError(RuntimeError):
    """A replica sharing this one's experts is gone: no replica of the group can step again."""


class LockstepEngineCore(EngineCore):
    """Contract: as EngineCore, plus: every replica calls step() the same number of times (the
    lock-step loop calls it every round, busy or idle), each call being one agreement with the
    others and at most one forward. `request_stop()` on any replica makes `stopped` True on all of
    them at the same step; after that no step may run. `all_idle`: no replica had tokens at the
    last agreement."""

    steps_with_replicas = True

    def __init__(self, config: EngineConfig):
        par = config.parallel
        assert par.experts_span_replicas and par.data_parallel_rank is not None and par.master_port is not None, (
            "a lock-step replica needs its rank and the replicas' meeting port (DataParallelEngine sets them)")
        self.stop_requested = False
        self.stopped = False
        self.all_idle = True
        self.group = None
        super().__init__(config)

    def _make_executor(self):
        """Join the replicas' world first: MoE layers take their experts from its group when built."""
        from atom_core.distributed.checks import check_parallel

        par = self.config.parallel
        check_parallel(par, self.model)
        if self.model.device.type == "cuda":
            torch.cuda.set_device(self.model.device)  # NCCL binds this process to its replica's GPU
        else:  # the replicas share the host's cores (and wait for each other every layer)
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // par.data_parallel_size))
        self.group = init_replica_experts(par.data_parallel_rank, par.data_parallel_size,
                                          f"tcp://{par.master_addr}:{par.master_port}", self.model.device)
        if par.data_parallel_rank == 0:
            logger.info("data parallel attention over %d replicas, experts split over them (expert parallel); "
                        "lock-step with dummy forwards when idle; decode %s", par.data_parallel_size,
                        "in CUDA graphs at an agreed size" if self.config.use_cuda_graphs else "eagerly (no CUDA graphs)")
        try:
            return super()._make_executor()
        except BaseException:
            destroy_distributed()
            raise

    def shutdown(self) -> None:
        super().shutdown()
        runner = getattr(self.executor, "runner", None)
        if runner is not None:  # a live graph that captured NCCL kernels blocks the group's teardown
            runner.release_graphs()
        destroy_distributed()

    def step(self):
        try:
            return super().step()
        except RuntimeError as e:  # a collective failed: name the likely cause
            if not any(word in str(e).lower() for word in ("gloo", "nccl", "connection")):
                raise
            raise ReplicaLostError(f"data-parallel replica {self.config.parallel.data_parallel_rank}: a collective with "
                                   "the replicas that share its experts failed; another replica has died "
                                   f"({str(e).splitlines()[0]})") from e

    def request_stop(self) -> None:
        """Stop at the next agreement, together with the other replicas."""
        self.stop_requested = True

    def _launch_next(self, previous):
        out = self.scheduler.schedule()
        graphs = self.executor.runner.dispatcher.full
        graphable = not out.req_ids or (graphs is not None and out.is_decode_only and out.total_tokens == len(out)
                                        and graphs.can_run(len(out)))
        counts, all_graphable = self._agree(out.total_tokens, graphable)
        if self.stopped or self.all_idle:
            return None
        size = lockstep_graph_size(counts, all_graphable, graphs.sizes if graphs is not None else ())
        # Every replica pads to the agreed graph; eagerly, a replica without tokens brings one padding token.
        counts = [size] * len(counts) if size is not None else [c or 1 for c in counts]
        with agreed_token_counts(counts, graph_size=size):
            if not out.req_ids:
                self.executor.runner.run_dummy_forward()
                return None
            return self._launch(out, previous)

    def _agree(self, num_tokens: int, graphable: bool = False) -> tuple[list[int], list[bool]]:
        """Every replica's token count for this step and whether it could replay a decode graph
        (replica order); sets `stopped` and `all_idle`."""
        mine = torch.tensor([num_tokens, int(self.stop_requested), int(graphable)], dtype=torch.int64)
        gathered = [torch.empty(3, dtype=torch.int64) for _ in range(self.group.world_size)]
        dist.all_gather(gathered, mine, group=self.group.cpu_group)
        counts = [int(g[0]) for g in gathered]
        self.stopped = any(int(g[1]) for g in gathered)
        self.all_idle = not any(counts)
        return counts, [bool(g[2]) for g in gathered]
