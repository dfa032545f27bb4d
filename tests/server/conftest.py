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


def start_server(model: Path, log_dir: Path, *extra: str, api_key: str | None = None) -> ServerProcess:
    port = free_port()
    log_path = log_dir / f"serve_{port}.log"
    cmd = [*atomctl_cmd(), "serve", "--model", str(model), "--port", str(port), *ENGINE_ARGS, *extra]
    if api_key:
        cmd += ["--api-key", api_key]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = ServerProcess(proc, port, log_path, str(model), api_key)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"atomctl serve exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop(signal.SIGKILL)
    raise AssertionError(f"atomctl serve not healthy after {STARTUP_TIMEOUT_S} s:\n{server.log()}")


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
