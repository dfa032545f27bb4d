"""A serving soak: many streams against a running server, some clients hanging up mid-stream, then the
checks a long-running deployment needs: every request that was not abandoned finished whole, the KV
cache is all free again once the server is idle, and the engine's memory did not grow.

C workers each keep a keep-alive connection and send streaming /v1/completions one after another
(token-id prompts, ignore_eos, so every request wants exactly `output_len` tokens). A seeded draw picks
`disconnect_fraction` of the requests to abandon: their worker reads a random number of events, then
closes the connection (a client that went away) and opens a new one for its next request. Prompts
start with their request's index, so no two share a cached prefix.

Memory is the server's `engine_memory_bytes` gauge (/metrics): read after a warm-up round of C
requests, so the allocator has grown to its working size, and again after the soak once the server is
idle. Leaked KV blocks: kv_cache_blocks_total - kv_cache_blocks_free when idle (blocks the prefix
cache keeps are free: they are reused on demand).
"""
from __future__ import annotations

import asyncio
import random
import time
import urllib.parse
from dataclasses import asdict, dataclass, field

import httpx

from atom_core.bench.stream_client import StreamError, send_request, stream_events, usage_tokens

_PATH = "/v1/completions"
_ERRORS_KEPT = 5


@dataclass(frozen=True)
class SoakConfig:
    base_url: str
    num_prompts: int = 2000
    concurrency: int = 512
    disconnect_fraction: float = 0.2
    input_len: int = 256
    output_len: int = 128
    vocab_size: int = 32000  # prompt token ids are drawn below this (at most the model's vocabulary)
    seed: int = 0
    model: str | None = None  # the served name; None: the first of /v1/models
    settle_timeout_s: float = 60.0
    max_memory_growth_mb: float = 64.0

    def __post_init__(self) -> None:
        for name, flag in (("num_prompts", "--num-prompts"), ("concurrency", "--max-concurrency"),
                           ("input_len", "--input-len"), ("output_len", "--output-len")):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.disconnect_fraction < 1.0:
            raise ValueError(f"--disconnect-fraction must be in [0, 1), got {self.disconnect_fraction}")
        if self.output_len < 2 and self.disconnect_fraction:
            raise ValueError("--output-len must be >= 2 for clients to disconnect mid-stream")
        if self.vocab_size < 2:
            raise ValueError(f"--vocab-size must be >= 2, got {self.vocab_size}")
        if self.max_memory_growth_mb < 0:
            raise ValueError(f"--max-memory-growth-mb must be >= 0, got {self.max_memory_growth_mb}")
        parsed = urllib.parse.urlsplit(self.base_url)
        if parsed.scheme != "http" or not parsed.hostname:
            raise ValueError(f"--base-url must be http://HOST[:PORT], got {self.base_url!r}")


@dataclass
class SoakResult:
    num_prompts: int
    concurrency: int
    completed: int = 0  # whole answers among the requests not abandoned
    failed: int = 0  # requests not abandoned that errored or came back short
    disconnected: int = 0
    server_aborts: int = 0  # requests the server ended as aborted during the soak: hang-ups before the last token
    errors: list[str] = field(default_factory=list)  # the first few failures
    duration_s: float = 0.0
    kv_blocks_total: int = 0
    kv_blocks_leaked: int = 0
    memory_baseline_mb: float = 0.0
    memory_final_mb: float = 0.0
    settled: bool = False  # the server reported no running, waiting or in-flight request
    problems: list[str] = field(default_factory=list)  # why the soak failed; empty: it passed

    @property
    def passed(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


@dataclass(frozen=True)
class _Request:
    index: int
    body: dict
    hang_up_after: int | None  # events to read before closing the connection; None: read it all


def build_requests(cfg: SoakConfig, model: str, count: int, first_index: int, rng: random.Random,
                   may_hang_up: bool) -> list[_Request]:
    out = []
    for i in range(first_index, first_index + count):
        prompt = [i % cfg.vocab_size] + [rng.randrange(1, cfg.vocab_size) for _ in range(cfg.input_len - 1)]
        hang_up = may_hang_up and rng.random() < cfg.disconnect_fraction
        body = {"model": model, "prompt": prompt, "max_tokens": cfg.output_len, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        out.append(_Request(i, body, rng.randint(1, cfg.output_len - 1) if hang_up else None))
    return out


async def _send(reader, writer, host: str, request: _Request) -> int:
    """One request; returns its completion tokens (usage) or raises StreamError. With hang_up_after,
    returns after that many events without reading the rest (the caller drops the connection)."""
    send_request(writer, host, _PATH, request.body)
    events, tokens, done = 0, None, False
    async for chunk in stream_events(reader):
        if chunk.startswith(b"data: [DONE]"):
            done = True
        elif (usage := usage_tokens(chunk)) is not None:
            tokens = usage
        elif chunk.startswith(b"data: {"):
            events += 1
            if request.hang_up_after is not None and events >= request.hang_up_after:
                return events
    if not done or tokens is None:
        raise StreamError(f"the stream ended without {'[DONE]' if not done else 'a usage event'}")
    return tokens


def _record_failure(result: SoakResult, message: str) -> None:
    result.failed += 1
    if len(result.errors) < _ERRORS_KEPT:
        result.errors.append(message[:300])


async def _worker(host: str, port: int, requests: list[_Request], output_len: int, result: SoakResult) -> None:
    reader = writer = None
    try:
        for request in requests:
            if writer is None:
                reader, writer = await asyncio.open_connection(host, port)
            try:
                tokens = await _send(reader, writer, host, request)
            except (StreamError, OSError, asyncio.IncompleteReadError, ValueError) as e:
                _record_failure(result, f"request {request.index}: {type(e).__name__}: {e}")
                writer.close()
                writer = None  # the connection's state is unknown after an error: a fresh one
                continue
            if request.hang_up_after is not None:
                result.disconnected += 1
                writer.transport.abort()  # a client that went away: no orderly close
                writer = None
            elif tokens == output_len:
                result.completed += 1
            else:
                _record_failure(result, f"request {request.index}: {tokens} of {output_len} tokens")
    finally:
        if writer is not None:
            writer.close()


async def _round(host: str, port: int, requests: list[_Request], cfg: SoakConfig, result: SoakResult) -> None:
    lanes = [requests[i::cfg.concurrency] for i in range(cfg.concurrency)]
    await asyncio.gather(*(_worker(host, port, lane, cfg.output_len, result) for lane in lanes if lane))


def scrape(client: httpx.Client) -> dict[str, float]:
    """The server's atom_* samples, keyed by name with labels as /metrics writes them."""
    samples: dict[str, float] = {}
    for line in client.get("/metrics").raise_for_status().text.splitlines():
        if line.startswith("atom_") and " " in line:
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples


def metric(samples: dict[str, float], name: str, label: str = "") -> float:
    """The sum of `name`'s samples (those whose labels hold `label`, e.g. 'finished_reason="abort"')."""
    return sum(v for k, v in samples.items() if k.split("{")[0] == name and label in k)


def wait_idle(client: httpx.Client, timeout_s: float) -> tuple[bool, dict[str, float]]:
    """Poll /metrics until nothing runs, waits or is in flight (True), or timeout_s passes (False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape(client)
        busy = [metric(m, f"atom_{n}") for n in ("num_requests_running", "num_requests_waiting",
                                                 "num_api_requests_in_flight")]
        if not any(busy) and metric(m, "atom_kv_cache_blocks_total"):
            return True, m
        if time.monotonic() >= deadline:
            return False, m
        time.sleep(0.2)


def run_soak(cfg: SoakConfig) -> SoakResult:
    url = urllib.parse.urlsplit(cfg.base_url)
    host, port = url.hostname, url.port or 80
    result = SoakResult(cfg.num_prompts, cfg.concurrency)
    rng = random.Random(cfg.seed)
    with httpx.Client(base_url=cfg.base_url, timeout=30) as client:
        model = cfg.model or client.get("/v1/models").raise_for_status().json()["data"][0]["id"]
        warm = SoakResult(cfg.concurrency, cfg.concurrency)  # the warm-up's own counts: not the soak's
        asyncio.run(_round(host, port, build_requests(cfg, model, cfg.concurrency, cfg.num_prompts, rng, False),
                           cfg, warm))
        if warm.failed:
            raise RuntimeError(f"the warm-up round failed ({warm.failed} of {cfg.concurrency}): {warm.errors[0]}")
        _, before = wait_idle(client, cfg.settle_timeout_s)
        start = time.perf_counter()
        asyncio.run(_round(host, port, build_requests(cfg, model, cfg.num_prompts, 0, rng, True), cfg, result))
        result.duration_s = round(time.perf_counter() - start, 2)
        result.settled, after = wait_idle(client, cfg.settle_timeout_s)
    result.kv_blocks_total = int(metric(after, "atom_kv_cache_blocks_total"))
    result.kv_blocks_leaked = result.kv_blocks_total - int(metric(after, "atom_kv_cache_blocks_free"))
    aborts = [metric(m, "atom_request_success_total", 'finished_reason="abort"') for m in (before, after)]
    result.server_aborts = int(aborts[1] - aborts[0])
    mb = 1 / 2**20
    result.memory_baseline_mb = round(metric(before, "atom_engine_memory_bytes") * mb, 1)
    result.memory_final_mb = round(metric(after, "atom_engine_memory_bytes") * mb, 1)
    result.problems = problems(result, cfg)
    return result


def problems(result: SoakResult, cfg: SoakConfig) -> list[str]:
    out = []
    if result.failed:
        out.append(f"{result.failed} requests not abandoned failed (first: {result.errors[0]})")
    if not result.settled:
        out.append(f"the server still had requests {cfg.settle_timeout_s:g} s after the last client finished")
    if result.kv_blocks_leaked:
        out.append(f"{result.kv_blocks_leaked} of {result.kv_blocks_total} KV blocks still held with the server idle")
    growth = result.memory_final_mb - result.memory_baseline_mb
    if growth > cfg.max_memory_growth_mb:
        out.append(f"the engine's memory grew {growth:.1f} MB over the soak (limit {cfg.max_memory_growth_mb:g} MB)")
    return out
