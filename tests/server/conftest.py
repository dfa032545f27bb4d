"""`atomctl serve` as a real subprocess on a free port, on a tiny CPU model."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx
import pytest

MAX_MODEL_LEN = 512
ENGINE_ARGS = ["--device", "cpu", "--kv-cache-memory-gb", "0.05", "--max-model-len", str(MAX_MODEL_LEN)]
STARTUP_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def atomctl_cmd() -> list[str]:
    exe = shutil.which("atomctl")
    return [exe] if exe else [sys.executable, "-c", "from atomctl.main import app; app()"]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path
    model_name: str
    api_key: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def openai(self, **kw):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0, **kw)

    def core_pid(self) -> int:
        """The engine core: the child started by multiprocessing's spawn (not its resource tracker)."""
        for pid in Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split():
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return int(pid)
        raise AssertionError(f"no engine core child of {self.proc.pid}")

    def metrics(self) -> dict[str, float]:
        """Unlabelled view of /metrics: `name` or `name{extra labels}` -> value."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                name, _, labels = key.partition("{")
                extra = ",".join(p for p in labels.rstrip("}").split(",") if p and not p.startswith("model_name="))
                out[f"{name}{{{extra}}}" if extra else name] = float(value)
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


# What a server's log says when its port was taken between free_port() and its bind (uvicorn, asyncio).
PORT_TAKEN = ("Address already in use", "error while attempting to bind")


def start_on_free_port(launch: Callable[[int, Path], subprocess.Popen], log_dir: Path, name: str,
                       timeout_s: float, attempts: int = 3) -> tuple[subprocess.Popen, int, Path]:
    """(process, port, log) of the server `launch(port, log_path)` starts, once GET /health answers 200.
    A port is free when picked and bound seconds later; when another process took it meanwhile (the
    server exits and its log says so: PORT_TAKEN) the server starts again on a fresh one."""
    deadline = time.monotonic() + timeout_s
    for _ in range(attempts):
        port = free_port()
        log_path = log_dir / f"{name}_{port}.log"
        proc = launch(port, log_path)
        while proc.poll() is None:
            if time.monotonic() > deadline:
                _kill(proc)
                raise AssertionError(f"{name} not healthy after {timeout_s:.0f} s:\n{log_path.read_text(errors='replace')}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    return proc, port, log_path
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        log = log_path.read_text(errors="replace")
        if not any(marker in log for marker in PORT_TAKEN):
            break
    raise AssertionError(f"{name} exited with {proc.returncode}:\n{log}")


def _kill(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(10)


def start_server(model: Path, log_dir: Path, *extra: str, api_key: str | None = None) -> ServerProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")

    def launch(port: int, log_path: Path) -> subprocess.Popen:
        cmd = [*atomctl_cmd(), "serve", "--model", str(model), "--port", str(port), *ENGINE_ARGS, *extra]
        if api_key:
            cmd += ["--api-key", api_key]
        with open(log_path, "wb") as log:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    proc, port, log_path = start_on_free_port(launch, log_dir, "serve", STARTUP_TIMEOUT_S)
    return ServerProcess(proc, port, log_path, str(model), api_key)


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    srv = start_server(tiny_llama, tmp_path_factory.mktemp("serve"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference_engine(tiny_llama):
    """The in-process LLMEngine with the server's engine settings: the oracle for served outputs."""
    from atom_core import LLMEngine

    return LLMEngine(str(tiny_llama), device="cpu", kv_cache_memory_gb=0.05, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="session")
def demo_tools_server(tmp_path_factory):
    """The demo model served with the Hermes tool parser, auto tool choice and the qwen3 reasoning
    parser (structured outputs, tool-calling and reasoning tests share it; the demo model writes
    no <think>, so its plain answers stay content)."""
    from atom_core.loader.model_dir import DEMO_MODEL_DIR

    srv = start_server(DEMO_MODEL_DIR, tmp_path_factory.mktemp("demo_tools"), "--tool-call-parser", "hermes",
                       "--enable-auto-tool-choice", "--reasoning-parser", "qwen3")
    yield srv
    srv.stop()
