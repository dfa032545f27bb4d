"""Tensor parallelism behind the Executor: rank 0's runner in the engine core's process, one
worker process per other rank of this node (and, with nnodes > 1, the other nodes' ranks in
their own `run_node_workers` processes).

Each step rank 0 broadcasts one compact message (the plain-data SchedulerOutput, which names
new requests once and then only ids, counts and new blocks) over the host gloo group; every
worker mirrors rank 0's launch/resolve order on its own runner, so all ranks run the same
forwards (their collectives meet) and sample the same tokens. Only rank 0 returns tokens.

Workers start as `python -m atom_core.worker.multiproc_executor` subprocesses (a daemonic core
process may not fork multiprocessing children) and read their setup from stdin. A watchdog
thread notices a worker that exits: the next launch/resolve raises WorkerDiedError, and if the
main thread is stuck inside a collective that will never complete (NCCL waits forever for a
dead peer) the process exits after a grace period rather than hang.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass

import torch

from atom_core.config import EngineConfig, ResolvedModel
from atom_core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from atom_core.worker.executor import Executor

logger = logging.getLogger(__name__)

_WATCH_S = 0.2
_STUCK_GRACE_S = 10.0  # a main thread still inside a collective this long after a death: exit


# Executors not yet shut down, for the one exit hook: a weak set, so that exit hooks do not keep a
# dropped engine's executor (and its process groups) alive until exit.
_LIVE: "weakref.WeakSet[MultiprocExecutor]" = weakref.WeakSet()


def _shutdown_live_executors() -> None:
    """At exit, for scripts that never call LLMEngine.shutdown()."""
    for executor in list(_LIVE):
        executor.shutdown()


atexit.register(_shutdown_live_executors)


def _check_no_live_world() -> None:
    """A second tensor-parallel engine in this process needs the first one's process groups gone.
    A dropped engine in a reference cycle leaves them only when the cyclic collector runs its
    `__del__`: collect first, then refuse with the way out instead of torch's "already initialized"."""
    import gc

    import torch.distributed as dist

    if dist.is_initialized():
        gc.collect()
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process: another tensor-parallel "
                           "engine is still running here; call its shutdown() (or use `with LLMEngine(...) as "
                           "llm:`) before starting the next one")


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process is gone; the engine cannot run another step."""


@dataclass(frozen=True)
class Step:
    """The per-step message. chains_previous: rank 0 launched this step before resolving the
    previous one (async scheduling), whose device samples may feed it."""

    out: SchedulerOutput
    chains_previous: bool


@dataclass(frozen=True)
class WorkerSetup:
    config: EngineConfig
    model: ResolvedModel
    rank: int
    init_method: str
    parent_pid: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_model(config: EngineConfig, model: ResolvedModel, rank: int) -> ResolvedModel:
    """The model part as rank `rank` sees it: GPUs are numbered per node, from the replica's
    first GPU (cuda:N: a data-parallel replica's offset)."""
    if model.device.type != "cuda":
        return model
    local = rank - config.parallel.node_rank * config.parallel.ranks_per_node
    return dataclasses.replace(model, device=torch.device("cuda", (model.device.index or 0) + local))


def _join(config: EngineConfig, model: ResolvedModel, rank: int, init_method: str):
    """Join the replica's process groups and build this rank's runner."""
    from atom_core.distributed import get_tp_group, init_distributed, set_expert_parallel
    from atom_core.distributed.communication import MessageBroadcaster
    from atom_core.worker.model_runner import ModelRunner

    if model.device.type == "cuda":
        torch.cuda.set_device(model.device)
    init_distributed(rank, config.parallel.world_size, init_method, model.device, all_reduce=config.kernel.all_reduce)
    set_expert_parallel(config.parallel.enable_expert_parallel)
    return MessageBroadcaster(get_tp_group()), ModelRunner


def start_worker(setup: WorkerSetup) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "atom_core.worker.multiproc_executor"], stdin=subprocess.PIPE,
                            start_new_session=False)
    proc.stdin.write(pickle.dumps(setup))
    proc.stdin.close()
    return proc


class MultiprocExecutor(Executor):
    """Contract: as Executor; plus `shutdown()` (idempotent) stops the workers and leaves the
    process groups. Raises WorkerDiedError from launch/resolve once a worker has exited."""

    def __init__(self, config: EngineConfig, model: ResolvedModel, profiler=None):
        par = config.parallel
        assert par.node_rank == 0, "the engine core runs on node 0; other nodes run run_node_workers"
        _check_no_live_world()
        port = par.master_port or free_port()
        init_method = f"tcp://{par.master_addr}:{port}"
        self.workers: dict[int, subprocess.Popen] = {}
        self.dead_reason: str | None = None
        self._in_call = False
        self._closed = False
        for rank in par.local_ranks:
            if rank:
                self.workers[rank] = start_worker(WorkerSetup(config, rank_model(config, model, rank), rank,
                                                              init_method, os.getpid()))
        _LIVE.add(self)
        self._watchdog = threading.Thread(target=_watch, args=(weakref.ref(self),), name="atom-tp-watchdog",
                                          daemon=True)
        self._watchdog.start()
        try:
            self.broadcaster, runner_cls = self._guard(_join, config, rank_model(config, model, 0), 0, init_method)
            self.runner = self._guard(runner_cls, config, rank_model(config, model, 0), profiler)
        except BaseException:
            self.shutdown()
            raise
        self.num_kv_blocks = self.runner.num_kv_blocks
        self.num_state_slots = self.runner.num_state_slots
        logger.info("tensor parallel over %d ranks (%d on this node) via %s", par.world_size, len(par.local_ranks),
                    init_method)

    # ---- failure handling -------------------------------------------------------------
    def _check_workers(self) -> None:
        """One watchdog round: record the first worker found dead; exit the process when the main
        thread stays stuck in a collective with it."""
        for rank, proc in self.workers.items():
            code = proc.poll()
            if code is not None and not self._closed and self.dead_reason is None:
                self.dead_reason = (f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {code}; "
                                    "the engine cannot continue")
                logger.error(self.dead_reason)
                deadline = time.monotonic() + _STUCK_GRACE_S
                while self._in_call and time.monotonic() < deadline:
                    time.sleep(_WATCH_S)
                if self._in_call:  # blocked in a collective the dead rank will never join
                    logger.error("rank 0 is stuck in a collective with the dead worker; exiting")
                    os._exit(70)

    def _guard(self, fn, *args):
        if self.dead_reason is not None:
            raise WorkerDiedError(self.dead_reason)
        self._in_call = True
        try:
            return fn(*args)
        except RuntimeError as e:  # a collective failed: say which worker died, if one did
            time.sleep(2 * _WATCH_S)  # let the watchdog see the exit
            if self.dead_reason is not None:
                raise WorkerDiedError(self.dead_reason) from e
            if any(word in str(e).lower() for word in ("gloo", "nccl", "connection")):  # a rank on another node
                raise WorkerDiedError(f"a collective with the other tensor-parallel ranks failed ({str(e).splitlines()[0]}); "
                                      "a worker process, possibly on another node, has died") from e
            raise
        finally:
            self._in_call = False

    # ---- the Executor interface -------------------------------------------------------
    def launch(self, out: SchedulerOutput, previous=None):
        def run():
            self.broadcaster.broadcast(Step(out, previous is not None))
            return self.runner.launch(out, previous)

        return self._guard(run)

    def resolve(self, handle) -> ModelRunnerOutput:
        return self._guard(self.runner.resolve, handle)

    def graph_batch_size(self, out: SchedulerOutput) -> int | None:
        return self.runner.graph_batch_size(out)

    @property
    def startup_breakdown(self) -> dict[str, float]:
        return self.runner.startup_breakdown

    def shutdown(self) -> None:
        """Tell the workers to exit (None message), wait for them, leave the groups."""
        from atom_core.distributed import destroy_distributed

        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        alive = all(p.poll() is None for p in self.workers.values())
        if alive and self.dead_reason is None and hasattr(self, "broadcaster"):
            try:
                self.broadcaster.broadcast(None)
            except RuntimeError:
                pass  # a worker died meanwhile: it is killed below
        if hasattr(self, "runner"):
            self.runner.release_graphs()
        # Leave the groups while the workers leave too (NCCL's teardown may wait for every rank),
        # then wait for them.
        destroy_distributed(timeout_s=20.0 if alive else 2.0)
        for proc in self.workers.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _watch(executor_ref: "weakref.ref[MultiprocExecutor]") -> None:
    """The watchdog thread; it holds its executor weakly, so a dropped engine can be collected
    (and shut down) while the thread runs, and it ends with the executor."""
    while True:
        executor = executor_ref()
        if executor is None or executor._closed:
            return
        executor._check_workers()
        del executor
        time.sleep(_WATCH_S)


# ---- the worker side --------------------------------------------------------------------
def _exit_with_parent(parent_pid: int) -> None:
    """A worker never outlives the process that started it (its collectives would hang)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(0)


def run_worker(setup: WorkerSetup) -> None:
    """One rank's loop: receive each step's message, mirror rank 0's launch/resolve order."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when workers stop
    threading.Thread(target=_exit_with_parent, args=(setup.parent_pid,), daemon=True).start()
    if setup.model.device.type == "cpu":  # ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // setup.config.parallel.ranks_per_node))
    broadcaster, runner_cls = _join(setup.config, setup.model, setup.rank, setup.init_method)
    runner = runner_cls(setup.config, setup.model)
    last = None
    while True:
        step = broadcaster.broadcast()
        if step is None:
            break
        if step.chains_previous:
            pending = runner.launch(step.out, last)
            if last is not None:
                runner.resolve(last)
        else:
            if last is not None:
                runner.resolve(last)
            pending = runner.launch(step.out, None)
        last = pending
        if runner.proposer.num_draft_tokens:
            # Speculative steps resolve right after their launch on rank 0 (drafts come from
            # their tokens), and a proposer with a model (MTP, draft) runs collectives in
            # resolve: resolve now too, or rank 0 would wait in them for the next message.
            runner.resolve(last)
            last = None
    from atom_core.distributed import destroy_distributed

    runner.release_graphs()
    destroy_distributed(timeout_s=20.0)


def run_node_workers(config: EngineConfig) -> int:
    """A node other than 0 (nnodes > 1): run this node's ranks until the engine on node 0 ends
    them. Returns the exit code (the first non-zero worker code, else 0)."""
    from atom_core.loader import resolve_model, resolve_model_files

    par = config.parallel
    assert par.node_rank > 0, "node 0 runs the engine core"
    model = resolve_model(config.model, resolve_model_files(config.model.model, config.model.tokenizer))
    from atom_core.distributed.checks import check_parallel

    check_parallel(par, model)
    init_method = f"tcp://{par.master_addr}:{par.master_port}"
    procs = [start_worker(WorkerSetup(config, rank_model(config, model, r), r, init_method, os.getpid()))
             for r in par.local_ranks]
    logger.info("node %d of %d: ranks %s joining %s", par.node_rank, par.nnodes, list(par.local_ranks), init_method)
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c), 0)


def _worker_main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s [tp worker] %(message)s")
    setup = pickle.load(sys.stdin.buffer)
    run_worker(setup)
    # Exit now: a process group that could not be left cleanly must not hold the exit.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _worker_main()
