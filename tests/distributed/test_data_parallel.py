"""Data parallelism: two engine cores behind one API process, least outstanding requests first."""
import asyncio
import os
import signal
import threading

import httpx
import pytest

from atom_core import LLMEngine, SamplingParams
from atom_core.config import EngineConfig
from tests.server.conftest import start_server

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_dist_models):
    engine = LLMEngine(str(tiny_dist_models("llama")), kv_cache_memory_gb=0.02)
    return [o["token_ids"] for o in engine.generate(PROMPTS, PARAMS)]


def test_llm_engine_refuses_data_parallel(tiny_dist_models):
    with pytest.raises(ValueError, match="data-parallel replicas run behind `atomctl serve`"):
        LLMEngine(str(tiny_dist_models("llama")), data_parallel_size=2)


def test_replicas_get_their_own_gpus_and_ports():
    from atom_core.engine.dp_engine import replica_config

    cfg = EngineConfig.from_kwargs("m", device="cuda", tensor_parallel_size=2, data_parallel_size=2, master_port=7000)
    second = replica_config(cfg, 1)
    assert (second.model.device, second.parallel.master_port, second.parallel.data_parallel_size) == ("cuda:2", 7001, 1)
    assert [replica_config(cfg, i).profiler.profiler_rank_dir for i in (0, 1)] == ["dp0_tp0", "dp1_tp0"]


def test_profiler_rank_dir_is_one_directory_name():
    assert EngineConfig.from_kwargs("m", profiler_rank_dir="dp1_tp0").profiler.profiler_rank_dir == "dp1_tp0"
    for bad in ("a/b", "..", ""):
        with pytest.raises(ValueError, match="profiler_rank_dir.*one directory name"):
            EngineConfig.from_kwargs("m", profiler_rank_dir=bad)


@pytest.fixture(scope="module")
def dp2_server(tiny_dist_models, tmp_path_factory):
    """(server, its profiler directory): `atomctl serve -dp 2`, shared by the tests of a served DP engine
    (three processes to start); the profiler only records between /start_profile and /stop_profile."""
    log_dir = tmp_path_factory.mktemp("dp2")
    traces = log_dir / "traces"
    srv = start_server(tiny_dist_models("llama"), log_dir, "-dp", "2", "--torch-profiler-dir", str(traces))
    yield srv, traces
    srv.stop()


def test_each_replica_profiles_into_its_own_directory(dp2_server):
    """Both replicas used to write to rank_0 (a trace of one could overwrite the other's)."""
    srv, traces = dp2_server
    assert httpx.post(f"{srv.url}/start_profile", timeout=30).status_code == 200
    body = {"model": srv.model_name, "prompt": PROMPTS[0], "max_tokens": 4}
    assert httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).status_code == 200
    stopped = httpx.post(f"{srv.url}/stop_profile", timeout=60).json()
    dirs = sorted(os.path.relpath(os.path.dirname(p), traces) for p in stopped["traces"])
    assert dirs == ["dp0_tp0", "dp1_tp0"], stopped
    assert all(os.path.exists(p) for p in stopped["traces"])


def test_balancer_spreads_requests_and_a_dead_replica_fails_health(tiny_dist_models, reference):
    from atom_core.engine.async_engine import EngineDeadError
    from atom_core.engine.dp_engine import DataParallelEngine

    config = EngineConfig.from_kwargs(str(tiny_dist_models("llama")), data_parallel_size=2, kv_cache_memory_gb=0.02,
                                      device="cpu")
    engine = DataParallelEngine(config)
    engine.start()
    deaths = []
    engine.on_dead.append(deaths.append)

    async def one(i):
        state = None
        async for state in engine.generate(f"r{i}", PROMPTS[i], PARAMS):
            pass
        return state.token_ids

    async def main():
        engine.attach(asyncio.get_running_loop())
        outputs = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
        assert engine.num_routed == [2, 2]  # least outstanding: they alternate while all run
        assert list(outputs) == reference
        stats = await engine.stats()
        assert stats.num_kv_blocks == engine.info.num_kv_blocks
        os.kill(engine.replicas[1].pid, signal.SIGKILL)
        for _ in range(100):  # the reader thread notices within its poll interval
            if not engine.is_healthy and deaths:
                break
            await asyncio.sleep(0.1)
        assert not engine.is_healthy
        with pytest.raises(EngineDeadError):
            engine.check_health()
        assert deaths and deaths[0].startswith("data-parallel replica 1:")

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_dp2_server_serves_requests(dp2_server, reference):
    srv, _ = dp2_server
    results = {}

    def post(i):
        body = {"model": srv.model_name, "prompt": PROMPTS[i], "max_tokens": 24, "temperature": 0,
                "ignore_eos": True}
        results[i] = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)

    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(results[i].status_code == 200 for i in range(len(PROMPTS))), [r.text for r in results.values()]
    cores = [p for p in open(f"/proc/{srv.proc.pid}/task/{srv.proc.pid}/children").read().split()
             if b"spawn_main" in open(f"/proc/{p}/cmdline", "rb").read()]
    assert len(cores) == 2
    assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
