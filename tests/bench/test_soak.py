"""`atomctl bench soak` against a real `atomctl serve` (tiny llama, CPU) and against a fake server whose
answers come back short, whose KV blocks stay held and whose memory grows: the soak passes the first
and names each failure of the second."""
from __future__ import annotations

import json
import socket
import subprocess
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from tests.server.conftest import atomctl_cmd, free_port, start_server

TINY_VOCAB = 390  # below the tiny llama's 397 ids


def soak(base_url: str, tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = tmp_path / "soak.json"
    run = subprocess.run([*atomctl_cmd(), "bench", "soak", "--base-url", base_url, "--output-json", str(out), *args],
                         capture_output=True, text=True, timeout=300)
    return run, json.loads(out.read_text()) if out.exists() else None


@pytest.fixture(scope="module")
def tiny_server(tiny_llama, tmp_path_factory):
    srv = start_server(tiny_llama, tmp_path_factory.mktemp("soak_serve"))
    yield srv
    srv.stop()


def test_soak_of_a_real_server_passes_with_clients_hanging_up(tiny_server, tmp_path):
    run, result = soak(tiny_server.url, tmp_path, "--num-prompts", "120", "--max-concurrency", "24",
                       "--disconnect-fraction", "0.3", "--input-len", "24", "--output-len", "32",
                       "--vocab-size", str(TINY_VOCAB))
    assert run.returncode == 0, run.stdout + run.stderr
    assert result["passed"] and result["failed"] == 0 and result["problems"] == []
    assert result["completed"] + result["disconnected"] == 120 and 20 <= result["disconnected"] <= 60
    assert 0 <= result["server_aborts"] <= result["disconnected"]
    assert result["kv_blocks_leaked"] == 0 and result["kv_blocks_total"] > 0 and result["settled"]
    assert result["memory_baseline_mb"] > 0 and result["memory_final_mb"] > 0  # the core's resident set
    assert "passed" in run.stdout


def test_same_seed_hangs_up_the_same_clients(tiny_server, tmp_path):
    args = ("--num-prompts", "40", "--max-concurrency", "8", "--input-len", "8", "--output-len", "8",
            "--vocab-size", str(TINY_VOCAB), "--seed", "5")
    counts = [soak(tiny_server.url, tmp_path, *args)[1]["disconnected"] for _ in range(2)]
    assert counts[0] == counts[1] > 0


class _LeakyServer:
    """/v1/completions streams `output_len` token events, one short for odd first prompt ids below 20;
    /metrics keeps 10 of 100 KV blocks used and grows the memory gauge 100 MB a scrape; busy: whole answers,
    and a running request at every scrape (a server that never goes idle)."""

    def __init__(self, busy: bool = False) -> None:
        self.scrapes, self.busy = 0, busy
        self.app = FastAPI()
        self.app.get("/v1/models")(lambda: {"data": [{"id": "fake"}]})
        self.app.post("/v1/completions")(self.completions)
        self.app.get("/metrics")(self.metrics)

    async def completions(self, request: Request):
        body = await request.json()
        first, n = body["prompt"][0], body["max_tokens"]
        n -= not self.busy and first < 20 and first % 2

        async def events():
            for _ in range(n):
                yield 'data: {"choices":[{"index":0,"text":"a"}]}\n\n'
            yield f'data: {{"choices":[],"usage":{{"completion_tokens":{n}}}}}\n\n'
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    def metrics(self):
        self.scrapes += 1
        labels = '{model_name="fake"}'
        lines = [f"atom_num_requests_running{labels} {float(self.busy)}", f"atom_num_requests_waiting{labels} 0.0",
                 f"atom_num_api_requests_in_flight{labels} 0.0", f"atom_kv_cache_blocks_total{labels} 100.0",
                 f"atom_kv_cache_blocks_free{labels} 90.0", f"atom_engine_memory_bytes{labels} {self.scrapes * 100 * 2**20}"]
        return PlainTextResponse("\n".join(lines) + "\n")


def _serve(app: FastAPI):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def leaky_server():
    yield from _serve(_LeakyServer().app)


@pytest.fixture
def busy_server():
    yield from _serve(_LeakyServer(busy=True).app)


def test_soak_names_short_answers_held_blocks_and_memory_growth(leaky_server, tmp_path):
    run, result = soak(leaky_server, tmp_path, "--num-prompts", "20", "--max-concurrency", "4",
                       "--disconnect-fraction", "0", "--input-len", "4", "--output-len", "6")
    assert run.returncode == 3, run.stdout + run.stderr
    assert not result["passed"] and result["failed"] == 10 and result["completed"] == 10
    assert result["kv_blocks_leaked"] == 10 and result["memory_final_mb"] - result["memory_baseline_mb"] == 100
    failed = [line for line in run.stdout.splitlines() if line.startswith("FAILED: ")]
    assert len(failed) == 3
    assert "10 requests not abandoned failed" in failed[0] and "5 of 6 tokens" in failed[0]
    assert "10 of 100 KV blocks still held" in failed[1] and "memory grew 100.0 MB" in failed[2]


def test_settle_timeout_bounds_the_wait_for_an_idle_server(busy_server, tmp_path):
    started = time.monotonic()
    run, result = soak(busy_server, tmp_path, "--num-prompts", "4", "--max-concurrency", "2", "--input-len", "4",
                       "--output-len", "30", "--disconnect-fraction", "0", "--settle-timeout", "0.5")
    assert run.returncode == 3, run.stdout + run.stderr
    assert not result["settled"] and time.monotonic() - started < 60
    assert "the server still had requests 0.5 s after the last client finished" in run.stdout


@pytest.mark.parametrize("args,message", [
    (["--disconnect-fraction", "1.5"], "--disconnect-fraction must be in [0, 1), got 1.5"),
    (["--max-concurrency", "0"], "--max-concurrency must be >= 1, got 0"),
    (["--output-len", "1"], "--output-len must be >= 2 for clients to disconnect mid-stream"),
    (["--base-url", "ftp://host"], "--base-url must be http://HOST[:PORT], got 'ftp://host'"),
    (["--max-memory-growth-mb", "-1"], "--max-memory-growth-mb must be >= 0, got -1.0"),
])
def test_bad_options_are_one_clear_line(tmp_path, args, message):
    run, result = soak("http://127.0.0.1:9", tmp_path, *args)
    assert run.returncode == 1 and result is None
    assert run.stderr.strip() == f"error: {message}"


def test_no_server_is_a_clear_error(tmp_path):
    run, result = soak(f"http://127.0.0.1:{free_port()}", tmp_path, "--num-prompts", "2")
    assert run.returncode == 1 and result is None
    assert run.stderr.startswith("error: ") and "onnect" in run.stderr and "Traceback" not in run.stderr
