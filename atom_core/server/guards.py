"""The server's outermost ASGI layer: body limits, the drain gate, in-flight accounting.

`RequestGuard` runs before FastAPI parses anything:
- stamps each request's arrival time (`request.state.arrival_time`, time.perf_counter()), so
  TTFT and latency count from the moment the API process saw the request;
- reads a request body itself: over `max_request_bytes` -> 413 (the excess is read and
  dropped, never buffered or parsed), not complete within `body_read_timeout` seconds -> 408;
  then hands the buffered body to the app;
- while the server drains (after SIGTERM), answers new requests with 503
  (`server_shutting_down`); /metrics stays open;
- counts the requests in flight (all but /health and /metrics) until their response is sent,
  which is what a drain waits for.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from atom_core.server.protocol import error_body

UNGUARDED_PATHS = frozenset({"/health", "/metrics", "/ping", "/version"})  # not counted as in flight
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


@dataclass
class ServerState:
    """Shared between the guard (which updates it) and the app's lifecycle (which reads it)."""

    max_request_bytes: int
    body_read_timeout: float
    draining: bool = False
    num_in_flight: int = 0


class RequestGuard:
    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["arrival_time"] = time.perf_counter()
        path = scope["path"]
        if self.state.draining and path != "/metrics":
            return await _reply(send, 503, error_body(
                "the server is shutting down; retry on another replica", "server_error", code="server_shutting_down"))
        counted = path not in UNGUARDED_PATHS
        if counted:
            self.state.num_in_flight += 1
        try:
            if scope["method"] in _BODY_METHODS:
                receive = await self._buffered_body(scope, receive, send)
                if receive is None:
                    return  # already answered (413 / 408 / client gone)
            await self.app(scope, receive, send)
        finally:
            if counted:
                self.state.num_in_flight -= 1

    async def _buffered_body(self, scope, receive, send):
        """Read the whole body within the limits; a receive() that replays it, or None."""
        limit = self.state.max_request_bytes
        deadline = time.monotonic() + self.state.body_read_timeout
        declared = _content_length(scope)
        too_large = declared is not None and declared > limit  # known before a byte is read
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                if too_large:
                    break
                await _reply(send, 408, error_body(
                    f"the request body did not arrive within {self.state.body_read_timeout:g} s "
                    "(--body-read-timeout)", "invalid_request_error", code="request_timeout"), close=True)
                return None
            if message["type"] == "http.disconnect":
                return None
            size += len(message.get("body", b""))
            too_large = too_large or size > limit
            if not too_large:  # past the limit the rest is read and dropped: a client that
                chunks.append(message.get("body", b""))  # sends before it reads then sees the 413
            if not message.get("more_body", False):
                break
        if too_large:
            await _reply(send, 413, _too_large(max(size, declared or 0), limit), close=True)
            return None
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls wait for the disconnect, as the app expects

        return replay


def _content_length(scope) -> int | None:
    for key, value in scope.get("headers", ()):
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _too_large(size: int, limit: int) -> dict:
    return error_body(f"the request body is {size} bytes; the limit is {limit} bytes "
                      "(--max-request-bytes)", "invalid_request_error", code="request_too_large")


async def _reply(send, status: int, body: dict, close: bool = False) -> None:
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    if close:  # the rest of the body was never read: this connection cannot carry another request
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
