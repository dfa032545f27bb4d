"""Start `atomctl serve` as a child process for an evaluation, wait until it is ready, stop it.

The server runs in its own session (process group), so a Ctrl-C in the terminal reaches only
the evaluation, which then stops the server itself: SIGTERM (the server drains and shuts its
engine core down), then SIGKILL to the whole group if it has not exited in time.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HEALTH_POLL_S = 0.5
STOP_TIMEOUT_S = 30.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """`atomctl serve --model M` on 127.0.0.1 and a free port; a context manager.

    `__enter__` returns once GET /health answers 200; it raises RuntimeError (with the end of the
    server's log) if the server exits first or `ready_timeout_s` passes. `__exit__` always stops it.
    """

    def __init__(self, model: str, served_model_name: str, extra_args: tuple[str, ...] = (),
                 host: str = "127.0.0.1", port: int | None = None, ready_timeout_s: float = 600.0):
        self.model = model
        self.served_model_name = served_model_name
        self.extra_args = extra_args
        self.host = host
        self.port = port or free_port(host)
        self.ready_timeout_s = ready_timeout_s
        self._proc: subprocess.Popen | None = None
        self._log_path: Path | None = None

    @property
    def root_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "atomctl", "serve", "--model", self.model, "--host", self.host,
                "--port", str(self.port), "--served-model-name", self.served_model_name, *self.extra_args]

    def __enter__(self) -> ServerProcess:
        fd, log_path = tempfile.mkstemp(prefix="atomctl-eval-serve-", suffix=".log")
        self._log_path = Path(log_path)
        with os.fdopen(fd, "wb") as log:
            self._proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"`atomctl serve` exited with code {self._proc.returncode} before it was "
                                   f"ready; its log ends:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.root_url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(HEALTH_POLL_S)
        raise RuntimeError(f"`atomctl serve` was not ready after {self.ready_timeout_s:.0f}s; "
                           f"its log ends:\n{self.log_tail()}")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the server and its engine-core children
                proc.wait()
        if self._log_path is not None and proc is not None and proc.returncode in (0, -signal.SIGTERM):
            self._log_path.unlink(missing_ok=True)  # kept after a failure, for the error message's reader

    def log_tail(self, num_chars: int = 3000) -> str:
        if self._log_path is None or not self._log_path.exists():
            return ""
        return self._log_path.read_text(errors="replace")[-num_chars:]
