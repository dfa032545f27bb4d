"""`atomctl serve` with tensor parallelism on the CPU: one node with a worker process, and two
local "nodes" (two atomctl processes meeting at --master-port). A killed worker turns /health
and every request into a clear 503 engine_dead error, never a hang."""
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.distributed.dead_engine import assert_engine_dead
from tests.server.conftest import ENGINE_ARGS, atomctl_cmd, free_port, start_server

BODY = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _workers_under(pid: int) -> list[int]:
    """Descendants of `pid` running a tensor-parallel worker."""
    found, todo = [], [pid]
    while todo:
        for child in _children(todo.pop()):
            todo.append(child)
            if b"multiproc_executor" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
    return found


def _complete(srv) -> list[int]:
    r = httpx.post(f"{srv.url}/v1/completions", json={**BODY, "model": srv.model_name}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def reference_text(tiny_dist_models):
    from atom_core import LLMEngine, SamplingParams

    engine = LLMEngine(str(tiny_dist_models("llama")), kv_cache_memory_gb=0.02)
    params = SamplingParams(temperature=0, max_tokens=BODY["max_tokens"], ignore_eos=True)
    return engine.generate([BODY["prompt"]], params)[0]["text"]


def test_tp2_server_serves_then_fails_fast_when_a_worker_dies(tiny_dist_models, tmp_path, reference_text):
    srv = start_server(tiny_dist_models("llama"), tmp_path, "--tensor-parallel-size", "2")
    try:
        assert _complete(srv) == reference_text
        (worker,) = _workers_under(srv.proc.pid)
        os.kill(worker, signal.SIGKILL)
        # The next step finds the dead rank; a request in flight or new must fail, not hang.
        r = httpx.post(f"{srv.url}/v1/completions", json={**BODY, "model": srv.model_name}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert_engine_dead(srv, {**BODY, "model": srv.model_name}, time.monotonic() + 20)
        assert "tensor-parallel worker rank 1" in srv.log()
    finally:
        srv.stop()


def test_two_local_nodes(tiny_dist_models, tmp_path, reference_text):
    """Node 1 is a second `atomctl serve --node-rank 1` that runs rank 1 only; killing it fails
    node 0's engine at its next step."""
    model = tiny_dist_models("llama")
    for attempt in range(3):  # the master port is free when picked, bound seconds later: taken, try another
        multi = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", str(free_port())]
        log = open(tmp_path / f"node1_{attempt}.log", "wb")
        node1 = subprocess.Popen([*atomctl_cmd(), "serve", "--model", str(model), *ENGINE_ARGS, *multi,
                                  "--node-rank", "1"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            srv = start_server(model, tmp_path, *multi, "--node-rank", "0")
            break
        except AssertionError as e:
            os.killpg(node1.pid, signal.SIGKILL)
            node1.wait(10)
            if "EADDRINUSE" not in str(e) or attempt == 2:
                raise
    try:
        try:
            assert _workers_under(srv.proc.pid) == []  # rank 1 lives on "node 1"
            assert _complete(srv) == reference_text
            os.killpg(node1.pid, signal.SIGKILL)
            # No local process to watch: the next step's collective finds the dead rank.
            r = httpx.post(f"{srv.url}/v1/completions", json={**BODY, "model": srv.model_name}, timeout=30)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
            assert_engine_dead(srv, {**BODY, "model": srv.model_name}, time.monotonic() + 20)
            assert "possibly on another node" in srv.log()
        finally:
            srv.stop()
    finally:
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
        node1.wait(10)
