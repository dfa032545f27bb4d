"""`atomctl bench api-overhead`: the API process's cost per streamed token, with no model.

Starts the real server process (the FastAPI app, uvicorn, AsyncEngine, the core process and its
messages) over a stand-in core whose step costs a fixed `step_ms` of simulated device time
(bench/stand_in_core.py), then streams `--ignore-eos` completions of fixed lengths over real
sockets at each concurrency (bench/stream_client.py: a lean client, so that on a small machine
the client's CPU does not crowd out the server it measures), and reports per concurrency:

- sample-to-write latency (p50/p90/p99/max, ms): from the core having a step's tokens (stamped
  in the Outputs message) to the chunk's SSE write in the API process, per written chunk, and
  the hop's part (p50/p99): until the API process's reader thread has the message;
- API-process CPU per output token (µs; user + system of the server process, every thread,
  request intake included), the core process's, and the client's (it shares the machine); the
  kernel counts CPU time in 10 ms ticks, so runs need thousands of tokens for these to mean much;
- output tokens/s, TTFT (request sent to first token event) and TPOT (first to last token event
  over the tokens after the first) as the client saw them, and the decode steps/s one stream got
  (1000 / median TPOT) against the stand-in's 1000 / step_ms.
"""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
from rich.console import Console
from rich.table import Table

_STARTUP_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class ApiOverheadConfig:
    model: str = "preset:Llama-3-8B"
    concurrencies: tuple[int, ...] = (64, 256)
    step_ms: float = 15.0
    input_len: int = 1024
    output_len: int = 128
    requests_per_stream: int = 2
    max_num_batched_tokens: int = 8192
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.concurrencies or any(c < 1 for c in self.concurrencies):
            raise ValueError(f"--concurrency needs values >= 1, got {list(self.concurrencies)}")
        if not (self.step_ms >= 0 and math.isfinite(self.step_ms)):
            raise ValueError(f"--step-ms must be >= 0, got {self.step_ms}")
        for name in ("input_len", "output_len", "requests_per_stream", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")


class StandInServer:
    """The server subprocess (bench/api_overhead_server.py) and its engine core child."""

    def __init__(self, cfg: ApiOverheadConfig, log_path: Path):
        cmd = [sys.executable, "-m", "atom_core.bench.api_overhead_server", "--model", cfg.model,
               "--step-ms", str(cfg.step_ms), "--max-num-seqs", str(max(cfg.concurrencies)),
               "--max-num-batched-tokens", str(cfg.max_num_batched_tokens)]
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, start_new_session=True,
                                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            self.port = self._read_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        self.process = psutil.Process(self.proc.pid)

    def _read_port(self) -> int:
        line: list[bytes] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(_STARTUP_TIMEOUT_S)
        text = line[0].decode() if line else ""
        if not text.startswith("PORT "):
            raise RuntimeError(f"the stand-in server did not start (see {self.log_path}):\n{self._log_tail()}")
        return int(text.split()[1])

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the stand-in server exited with {self.proc.returncode}:\n{self._log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the stand-in server was not healthy after {_STARTUP_TIMEOUT_S:.0f} s")

    def _log_tail(self) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])

    def cpu_seconds(self) -> tuple[float, float]:
        """(API process, engine core and other children) CPU seconds so far, user + system."""
        api = self.process.cpu_times()
        core = 0.0
        for child in self.process.children(recursive=True):
            try:
                times = child.cpu_times()
            except psutil.NoSuchProcess:
                continue
            core += times.user + times.system
        return api.user + api.system, core

    def take_latencies(self) -> tuple[np.ndarray, np.ndarray]:
        """Per written chunk since the last call: (sample-to-write seconds, the core-to-API hop's part)."""
        response = httpx.get(self.url + "/_bench/latencies", timeout=60)
        response.raise_for_status()
        data = response.json()
        return np.asarray(data["seconds"], dtype=np.float64), np.asarray(data["hop_seconds"], dtype=np.float64)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def run_api_overhead(cfg: ApiOverheadConfig, log_dir: Path, console: Console | None = None) -> dict[str, Any]:
    """Start the stand-in server once, measure each concurrency, stop it; returns the result dict."""
    from atom_core.bench.datasets import DatasetConfig, sample_requests
    from atom_core.bench.serve_bench import load_tokenizer

    console = console or Console()
    tokenizer = load_tokenizer(cfg.model)
    dataset = DatasetConfig(random_input_len=cfg.input_len, random_output_len=cfg.output_len)
    log_dir.mkdir(parents=True, exist_ok=True)
    server = StandInServer(cfg, log_dir / "api_overhead_server.log")
    runs = []
    try:
        for concurrency in cfg.concurrencies:
            prompts = [r.prompt for r in sample_requests(dataset, tokenizer, concurrency * cfg.requests_per_stream,
                                                         cfg.seed)]
            bodies = [{"model": cfg.model, "prompt": p, "max_tokens": cfg.output_len, "temperature": 0.0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                      for p in prompts]
            _streams(server, bodies[:4], 4)  # first-use costs (imports, the tokenizer pool)
            server.take_latencies()
            runs.append(_measure(server, bodies, concurrency, cfg, console))
    finally:
        server.stop()
    return {"model": cfg.model, "step_ms": cfg.step_ms, "input_len": cfg.input_len, "output_len": cfg.output_len,
            "requests_per_stream": cfg.requests_per_stream, "cpu_count": os.cpu_count(), "runs": runs}


def _streams(server: StandInServer, bodies: list[dict], concurrency: int):
    from atom_core.bench.stream_client import run_streams

    return run_streams("127.0.0.1", server.port, "/v1/completions", bodies, concurrency)


def _measure(server: StandInServer, bodies: list[dict], concurrency: int, cfg: ApiOverheadConfig,
             console: Console) -> dict:
    client = psutil.Process()
    api0, core0 = server.cpu_seconds()
    client0 = sum(client.cpu_times()[:2])
    streams = _streams(server, bodies, concurrency)
    api1, core1 = server.cpu_seconds()
    client1 = sum(client.cpu_times()[:2])
    latencies_s, hops_s = server.take_latencies()
    latencies_ms, hops_ms = latencies_s * 1000, hops_s * 1000
    tokens = sum(r.num_tokens for r in streams.requests)
    assert tokens == len(bodies) * cfg.output_len, f"expected {len(bodies) * cfg.output_len} tokens, got {tokens}"
    ttft_ms = np.array([(r.first_event - r.sent) * 1000 for r in streams.requests])
    tpot_ms = np.array([(r.last_event - r.first_event) * 1000 / (cfg.output_len - 1)
                        for r in streams.requests]) if cfg.output_len > 1 else np.zeros(1)
    tpot = float(np.median(tpot_ms))
    events = sum(r.num_events for r in streams.requests)
    run = {
        "concurrency": concurrency,
        "num_requests": len(streams.requests),
        "duration_s": streams.duration_s,
        "output_tokens": tokens,
        "output_tok_s": tokens / streams.duration_s,
        "num_chunks": int(latencies_ms.size),
        "client_events": events,
        "tokens_per_chunk": tokens / max(events, 1),
        **{f"sample_to_write_{name}_ms": float(np.percentile(latencies_ms, p)) if latencies_ms.size else None
           for name, p in (("p50", 50), ("p90", 90), ("p99", 99), ("max", 100))},
        **{f"hop_{name}_ms": float(np.percentile(hops_ms, p)) if hops_ms.size else None
           for name, p in (("p50", 50), ("p99", 99))},
        "api_cpu_s": api1 - api0,
        "api_cpu_us_per_token": (api1 - api0) / tokens * 1e6,
        "api_cpu_util": (api1 - api0) / streams.duration_s,
        "core_cpu_us_per_token": (core1 - core0) / tokens * 1e6,
        "client_cpu_us_per_token": (client1 - client0) / tokens * 1e6,
        "median_ttft_ms": float(np.median(ttft_ms)),
        "p99_ttft_ms": float(np.percentile(ttft_ms, 99)),
        "median_tpot_ms": tpot,
        "steps_per_s_per_stream": 1000 / tpot if tpot else None,
        "stand_in_steps_per_s": 1000 / cfg.step_ms if cfg.step_ms else None,
    }
    console.print(f"concurrency {concurrency}: {run['output_tok_s']:,.0f} tok/s, sample-to-write p50 "
                  f"{run['sample_to_write_p50_ms']:.2f} ms, API CPU {run['api_cpu_us_per_token']:.1f} us/token")
    return run


_ROWS = [
    ("requests", "num_requests", "{:d}"), ("duration (s)", "duration_s", "{:.2f}"),
    ("output tok/s", "output_tok_s", "{:,.0f}"), ("tokens per SSE chunk", "tokens_per_chunk", "{:.2f}"),
    ("sample-to-write p50 (ms)", "sample_to_write_p50_ms", "{:.2f}"),
    ("sample-to-write p90 (ms)", "sample_to_write_p90_ms", "{:.2f}"),
    ("sample-to-write p99 (ms)", "sample_to_write_p99_ms", "{:.2f}"),
    ("sample-to-write max (ms)", "sample_to_write_max_ms", "{:.2f}"),
    ("  of which core-to-API hop p50 / p99 (ms)", ("hop_p50_ms", "hop_p99_ms"), "{:.2f} / {:.2f}"),
    ("API CPU per token (us)", "api_cpu_us_per_token", "{:.1f}"),
    ("API CPU busy (cores)", "api_cpu_util", "{:.2f}"),
    ("core CPU per token (us)", "core_cpu_us_per_token", "{:.1f}"),
    ("client CPU per token (us)", "client_cpu_us_per_token", "{:.1f}"),
    ("TTFT p50 / p99 (ms)", ("median_ttft_ms", "p99_ttft_ms"), "{:.0f} / {:.0f}"),
    ("TPOT p50 (ms)", "median_tpot_ms", "{:.2f}"),
    ("steps/s per stream (stand-in max)", ("steps_per_s_per_stream", "stand_in_steps_per_s"), "{} / {}"),
]


def result_table(result: dict[str, Any]) -> Table:
    table = Table(title=f"API overhead ({result['model']}, stand-in step {result['step_ms']:g} ms, "
                        f"{result['input_len']} in / {result['output_len']} out)")
    table.add_column("metric")
    for run in result["runs"]:
        table.add_column(f"c{run['concurrency']}", justify="right")
    for label, keys, fmt in _ROWS:
        cells = []
        for run in result["runs"]:
            values = [run[k] for k in (keys if isinstance(keys, tuple) else (keys,))]
            if fmt == "{} / {}":
                values = [f"{v:.1f}" if v is not None else "-" for v in values]
            cells.append(fmt.format(*values) if all(v is not None for v in values) else "-")
        table.add_row(label, *cells)
    return table
