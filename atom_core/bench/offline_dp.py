"""The offline throughput workload over data-parallel replicas (`bench offline -dp N`).

LLMEngine drives one engine core; data parallelism is several cores behind one balancer
(engine/dp_engine.py, what `atomctl serve -dp N` runs). This submits the whole workload to that
balancer at once, as LLMEngine.generate does to its one core, and times it the same way, so the
result compares with `bench offline` at DP=1 (the replicas' scaling is the quotient).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from atom_core.bench.offline import ThroughputResult, ThroughputWorkload
from atom_core.config import EngineConfig
from atom_core.sampling_params import SamplingParams


async def _run_all(engine, prompts: list[list[int]], params: list[SamplingParams], tag: str) -> list:
    async def one(i: int):
        final = None
        async for state in engine.generate(f"{tag}-{i}", prompts[i], params[i]):
            final = state
        return final

    return await asyncio.gather(*(one(i) for i in range(len(prompts))))


def run_throughput_replicas(config: EngineConfig, workload: ThroughputWorkload) -> tuple[ThroughputResult, dict]:
    """Start the replicas, run the workload once over them, stop them. Returns the result and
    the replicas' requests served each (the balancer's split)."""
    from atom_core.engine.dp_engine import DataParallelEngine

    start = time.perf_counter()
    engine = DataParallelEngine(config)
    info = engine.start()
    startup = time.perf_counter() - start
    loop = asyncio.new_event_loop()
    try:
        engine.attach(loop)
        # Token ids stay below the vocab (only tiny test models have fewer than 10,001 tokens).
        workload = replace(workload, max_token_id=min(workload.max_token_id, info.vocab_size - 1))
        prompts, params = workload.build()
        warm = [[1, 2, 3, 4]] * len(engine.replicas)  # one request per replica (the balancer spreads them)
        loop.run_until_complete(_run_all(engine, warm, [SamplingParams(max_tokens=4)] * len(warm), "warm"))
        served_before = list(engine.num_routed)
        begin = time.perf_counter()
        states = loop.run_until_complete(_run_all(engine, prompts, params, "bench"))
        elapsed = time.perf_counter() - begin
    finally:
        engine.shutdown()
        loop.close()
    n_in = sum(len(p) for p in prompts)
    n_out = sum(len(s.token_ids) for s in states)
    served = [after - before for after, before in zip(engine.num_routed, served_before)]
    result = ThroughputResult(len(prompts), n_in, n_out, elapsed, startup, n_out / elapsed, (n_in + n_out) / elapsed,
                              len(prompts) / elapsed)
    return result, {"requests_per_replica": served}
