"""Data parallelism: several engine cores (one AsyncEngine each, one per replica) behind the one
API process, with a least-outstanding-requests balancer.

Each replica is a whole engine (its own core process, KV cache and, with tensor parallelism,
its own workers and process groups on its own GPUs: replica i uses GPUs i*tp .. i*tp+tp-1).
With enable_expert_parallel on a MoE model the replicas share one expert-parallel group instead
and step in lock-step (engine/lockstep.py): DP attention + EP experts.
`DataParallelEngine` offers the AsyncEngine interface the server uses; a request goes to the
healthy replica with the fewest unfinished requests and stays there (aborts follow it).

Failure contract: the server serves only while every replica is healthy; when one dies, its
requests fail with its EngineDeadError, /health reports it, and the `on_dead` callbacks run
(the server then stops, as for a single engine).
"""
from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Callable

from atom_core.config import EngineConfig
from atom_core.engine.async_engine import AsyncEngine, CoreInfo, EngineDeadError


def replica_config(config: EngineConfig, index: int) -> EngineConfig:
    """Replica `index`'s config: its own GPUs; independent replicas are one replica each, with
    their own meeting port; replicas that share experts keep the data-parallel size, learn their
    rank and meet at the one port (config.master_port, which must be set)."""
    from atom_core.profiling.profiler import rank_dir_name

    par = config.parallel
    options: dict = {"profiler_rank_dir": rank_dir_name(0, index)}  # each replica's traces in its own dir
    model = config.model
    if model.torch_device.type == "cuda":
        options["device"] = f"cuda:{(model.torch_device.index or 0) + index * par.tensor_parallel_size}"
    if par.experts_span_replicas:
        assert par.master_port is not None, "replicas sharing experts meet at one port; choose it first"
        options["data_parallel_rank"] = index
    else:
        options["data_parallel_size"] = 1
        if par.master_port is not None:
            options["master_port"] = par.master_port + index
    return config.replace(**options)


class DataParallelEngine:
    """Contract: as AsyncEngine (start, attach, generate, abort, stats, ...), over
    `config.parallel.data_parallel_size` replicas; every method runs on the event loop."""

    def __init__(self, config: EngineConfig):
        if config.parallel.experts_span_replicas and config.parallel.master_port is None:
            from atom_core.worker.multiproc_executor import free_port

            config = config.replace(master_port=free_port())
        self.config = config
        self.replicas = [AsyncEngine(replica_config(config, i)) for i in range(config.parallel.data_parallel_size)]
        self.num_routed = [0] * len(self.replicas)  # requests sent to each replica so far
        self._owner: dict[str, AsyncEngine] = {}
        self.on_dead: list[Callable[[str], None]] = []
        self.info: CoreInfo | None = None
        self.tokenizer = None
        self.model_path = None
        self.processor = None
        for i, replica in enumerate(self.replicas):
            replica.on_dead.append(lambda reason, i=i: self._on_replica_dead(i, reason))

    # ---- lifecycle --------------------------------------------------------------------
    def start(self, **kwargs) -> CoreInfo:
        """Start every replica at once; all must come up. At the first failure the others are
        stopped (replicas that share experts would otherwise wait for the failed one)."""
        from atom_core.loader import resolve_model_files

        # Once here first: transformers' lazy imports are not thread-safe (a racing thread got
        # "cannot import name 'AutoConfig'").
        resolve_model_files(self.config.model.model, self.config.model.tokenizer).serving_tokenizer()
        with ThreadPoolExecutor(len(self.replicas)) as pool:
            futures = [pool.submit(r.start, **kwargs) for r in self.replicas]
            wait(futures, return_when=FIRST_EXCEPTION)
            failed = next((f.exception() for f in futures if f.done() and f.exception() is not None), None)
            if failed is not None:
                self.shutdown()  # the replicas still starting see their core exit, and return
        if failed is not None:
            raise failed
        first = self.replicas[0]
        self.tokenizer, self.processor, self.model_path = first.tokenizer, first.processor, first.model_path
        self.info = dataclasses.replace(first.info, num_kv_blocks=sum(r.info.num_kv_blocks for r in self.replicas))
        return self.info

    def attach(self, loop) -> None:
        for replica in self.replicas:
            replica.attach(loop)

    def shutdown(self, timeout: float = 10.0) -> None:
        for replica in self.replicas:  # all at once: replicas that share experts stop together
            replica.request_shutdown()
        for replica in self.replicas:
            replica.shutdown(timeout)

    @property
    def on_progress(self):
        return self.replicas[0].on_progress

    @on_progress.setter
    def on_progress(self, callback) -> None:
        for replica in self.replicas:
            replica.on_progress = callback

    @property
    def pid(self) -> int | None:
        return self.replicas[0].pid

    @property
    def is_healthy(self) -> bool:
        return all(r.is_healthy for r in self.replicas)

    @property
    def num_unfinished(self) -> int:
        return sum(r.num_unfinished for r in self.replicas)

    @property
    def latest_stats(self):
        stats = [r.latest_stats for r in self.replicas]
        return None if any(s is None for s in stats) else _combine_stats(stats)

    def check_health(self) -> None:
        for replica in self.replicas:
            replica.check_health()

    def _on_replica_dead(self, index: int, reason: str) -> None:
        for callback in self.on_dead:
            callback(f"data-parallel replica {index}: {reason}")

    # ---- requests ---------------------------------------------------------------------
    def validate_request(self, prompt_token_ids, params, mm_items=()) -> None:
        self.replicas[0].validate_request(prompt_token_ids, params, mm_items)

    def _pick(self) -> AsyncEngine:
        """The healthy replica with the fewest unfinished requests (ties: the lowest index)."""
        healthy = [i for i, r in enumerate(self.replicas) if r.is_healthy]
        if not healthy:
            self.check_health()  # raises the first replica's reason
            raise EngineDeadError("no data-parallel replica is running")
        index = min(healthy, key=lambda i: self.replicas[i].num_unfinished)
        self.num_routed[index] += 1
        return self.replicas[index]

    async def generate(self, request_id: str, *args, **kwargs) -> AsyncIterator:
        self.check_health()
        replica = self._pick()
        self._owner[request_id] = replica
        try:
            async for state in replica.generate(request_id, *args, **kwargs):
                yield state
        finally:
            self._owner.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        replica = self._owner.get(request_id)
        if replica is not None:
            replica.abort(request_id)

    def fail_pending(self, error: EngineDeadError) -> int:
        return sum(r.fail_pending(error) for r in self.replicas)

    # ---- calls into the cores ---------------------------------------------------------
    async def stats(self):
        return _combine_stats([await r.stats() for r in self.replicas])

    async def start_profile(self) -> None:
        for replica in self.replicas:
            await replica.start_profile()

    async def stop_profile(self) -> list[str]:
        return [path for r in self.replicas for path in await r.stop_profile()]


def _combine_stats(stats: list):
    """One CoreStats for all replicas: counts add up, rates average."""
    values = {}
    for f in dataclasses.fields(stats[0]):
        column = [getattr(s, f.name) for s in stats]
        if isinstance(column[0], float):
            values[f.name] = sum(column) / len(column)
        elif isinstance(column[0], int) and not isinstance(column[0], bool):
            values[f.name] = sum(column)
    return dataclasses.replace(stats[0], **values)
