"""What a served engine must do once a rank or replica has died: fail fast, never hang."""
from __future__ import annotations

import time

import httpx


def assert_engine_dead(srv, body: dict, deadline: float) -> None:
    """By `deadline` (time.monotonic()), /health answers 503 engine_dead; then a request with
    `body` gets the same 503 at once."""
    while time.monotonic() < deadline:
        health = httpx.get(f"{srv.url}/health", timeout=10)
        if health.status_code == 503:
            break
        time.sleep(0.2)
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead", health.text
    r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=20)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
