"""The test servers' start (conftest.start_on_free_port): a port taken between its pick and the
server's bind is a start on a fresh port; any other exit fails at once with the server's log."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.conftest import start_on_free_port

HEALTHY = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _launcher(scripts: list[str]):
    """launch(port, log) running the next script of `scripts` with the port as its argument."""
    started = []

    def launch(port: int, log_path: Path) -> subprocess.Popen:
        script = scripts[len(started)]
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, "-c", script, str(port)], stdout=log, stderr=subprocess.STDOUT)
        started.append(port)
        return proc

    return launch, started


def test_a_taken_port_starts_again_on_a_fresh_one(tmp_path):
    taken = "print('ERROR: [Errno 98] error while attempting to bind on address: address already in use')"
    launch, started = _launcher([taken, HEALTHY])
    proc, port, log_path = start_on_free_port(launch, tmp_path, "fake", timeout_s=60)
    try:
        assert len(started) == 2 and port == started[1] and proc.poll() is None
        assert log_path.name == f"fake_{port}.log"
    finally:
        proc.kill()
        proc.wait()


def test_another_exit_fails_at_once_with_the_log(tmp_path):
    launch, started = _launcher(["import sys; print('no model here'); sys.exit(3)", HEALTHY])
    with pytest.raises(AssertionError, match="fake exited with 3:\n.*no model here"):
        start_on_free_port(launch, tmp_path, "fake", timeout_s=60)
    assert len(started) == 1


def test_a_server_that_never_answers_is_killed_at_the_deadline(tmp_path):
    launch, started = _launcher(["import time; print('loading'); time.sleep(60)"])
    with pytest.raises(AssertionError, match="fake not healthy after 1 s:\n.*loading"):
        start_on_free_port(launch, tmp_path, "fake", timeout_s=1)


def test_atomctl_serve_on_a_taken_port_says_what_the_start_looks_for(tiny_llama, tmp_path):
    """The marker start_on_free_port retries on is what `atomctl serve` prints for a port in use."""
    import socket

    from tests.server.conftest import ENGINE_ARGS, PORT_TAKEN, atomctl_cmd

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        run = subprocess.run([*atomctl_cmd(), "serve", "--model", str(tiny_llama), "--port", str(port), *ENGINE_ARGS],
                             capture_output=True, text=True, timeout=300)
    assert run.returncode == 1
    assert any(marker in run.stdout + run.stderr for marker in PORT_TAKEN), run.stdout + run.stderr
