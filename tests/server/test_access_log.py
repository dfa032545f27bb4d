"""`atomctl serve --access-log`: every HTTP request gets a line in the server's log (uvicorn's access
log); by default (--no-access-log) none does."""
from __future__ import annotations

import time

import httpx

from tests.server.conftest import start_server


LINE = '"GET /v1/models HTTP/1.1" 200'


def _log_after(srv, path: str, wait_for: str | None = None) -> str:
    """The server's log after a GET of `path`: once it holds `wait_for`, or after a second."""
    assert httpx.get(f"{srv.url}{path}", timeout=10).status_code == 200
    deadline = time.monotonic() + (15 if wait_for else 1)  # the line is written after the response
    while time.monotonic() < deadline and not (wait_for and wait_for in srv.log()):
        time.sleep(0.1)
    return srv.log()


def test_access_log_names_each_request(tiny_llama, tmp_path):
    srv = start_server(tiny_llama, tmp_path, "--access-log")
    try:
        log = _log_after(srv, "/v1/models", wait_for=LINE)
        assert LINE in log, log[-2000:]
    finally:
        srv.stop()


def test_no_access_log_by_default(server):
    log = _log_after(server, "/v1/models")
    assert "GET /v1/models" not in log, log[-2000:]
