"""`atomctl serve --access-log`: every HTTP request gets a line in the server's log (uvicorn's access
log); by default (--no-access-log) none does."""
from __future__ import annotations

import time

import httpx

from tests.server.conftest import start_server


def _log_after(srv, path: str) -> str:
    assert httpx.get(f"{srv.url}{path}", timeout=10).status_code == 200
    time.sleep(0.5)  # the line is written after the response
    return srv.log()


def test_access_log_names_each_request(tiny_llama, tmp_path):
    srv = start_server(tiny_llama, tmp_path, "--access-log")
    try:
        log = _log_after(srv, "/v1/models")
        assert '"GET /v1/models HTTP/1.1" 200' in log, log[-2000:]
    finally:
        srv.stop()


def test_no_access_log_by_default(server):
    log = _log_after(server, "/v1/models")
    assert "GET /v1/models" not in log, log[-2000:]
