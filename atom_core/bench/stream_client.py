"""A lean streaming client for measuring a server on the same machine: raw HTTP/1.1 over asyncio
sockets, SSE events counted but not parsed.

`bench serve`'s httpx client spends CPU on every streamed token (httpx/h11 framing, line
splitting, one JSON parse per event); on a small machine that competes with the server it
measures, more than the server's own per-token work. This one reads the chunked body with two
awaits per event and parses nothing, so the server's numbers are the server's.

Each of `concurrency` workers keeps one keep-alive connection and sends its requests one after
another (all workers start at once: bench serve's --request-rate inf --max-concurrency N).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field


@dataclass
class StreamStats:
    """One request as the client saw it (perf_counter seconds)."""

    sent: float
    first_event: float | None = None
    last_event: float | None = None
    num_events: int = 0  # events with tokens
    num_tokens: int = 0  # completion_tokens of the usage event (the one event parsed)


@dataclass
class StreamRun:
    duration_s: float
    requests: list[StreamStats] = field(default_factory=list)


class StreamError(RuntimeError):
    """The server answered something other than a 200 event stream."""


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await reader.readline()
    if not status_line:
        raise StreamError("the server closed the connection before answering")
    status = int(status_line.split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


def send_request(writer: asyncio.StreamWriter, host: str, path: str, body: dict) -> None:
    """Write one JSON POST on the connection (HTTP/1.1 keep-alive)."""
    payload = json.dumps(body).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)


async def stream_events(reader: asyncio.StreamReader):
    """The answer's SSE events, one chunk each as uvicorn writes them (b"data: ...\n\n"), until the
    chunked body ends; StreamError for any answer but a 200 event stream, and for an error event."""
    status, headers = await _read_head(reader)
    if headers.get("transfer-encoding") != "chunked":
        size = int(headers.get("content-length", "0"))
        text = (await reader.readexactly(size)).decode(errors="replace")
        raise StreamError(f"HTTP {status}: {text[:300]}")
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        chunk = await reader.readexactly(size + 2)  # the data and its CRLF
        if size == 0:
            return
        if status != 200 or chunk.startswith(b'data: {"error"'):
            raise StreamError(f"HTTP {status}: {chunk[:300].decode(errors='replace')}")
        yield chunk


def usage_tokens(chunk: bytes) -> int | None:
    """completion_tokens of the usage event (it has no choices), None for any other event."""
    return json.loads(chunk[6:])["usage"]["completion_tokens"] if b'"choices":[]' in chunk else None


async def _one_request(reader, writer, host: str, path: str, body: dict) -> StreamStats:
    send_request(writer, host, path, body)
    stats = StreamStats(time.perf_counter())
    async for chunk in stream_events(reader):
        # the usage event has no choices; [DONE] ends the stream
        if (tokens := usage_tokens(chunk)) is not None:
            stats.num_tokens = tokens
        elif chunk.startswith(b"data: {"):
            now = time.perf_counter()
            if stats.first_event is None:
                stats.first_event = now
            stats.last_event = now
            stats.num_events += 1
    return stats


async def _worker(host: str, port: int, path: str, bodies: list[dict], out: list[StreamStats]) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        for body in bodies:
            out.append(await _one_request(reader, writer, host, path, body))
    finally:
        writer.close()


async def _run(host: str, port: int, path: str, bodies: list[dict], concurrency: int) -> StreamRun:
    per_worker = [bodies[i::concurrency] for i in range(concurrency)]
    results: list[list[StreamStats]] = [[] for _ in per_worker]
    start = time.perf_counter()
    await asyncio.gather(*(_worker(host, port, path, b, r) for b, r in zip(per_worker, results) if b))
    return StreamRun(time.perf_counter() - start, [s for r in results for s in r])


def run_streams(host: str, port: int, path: str, bodies: list[dict], concurrency: int) -> StreamRun:
    """Send every body (a streaming request) over `concurrency` connections at once; StreamError on
    any non-200 answer or error event."""
    return asyncio.run(_run(host, port, path, bodies, concurrency))
