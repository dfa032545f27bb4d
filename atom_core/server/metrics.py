"""Prometheus text exposition for /metrics, without a client library.

Counters and histograms live in the API process (it sees every request finish); gauges of
the scheduler and KV cache come from the core (`CoreStats`) when /metrics is scraped.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from atom_core.engine.output_processor import RequestState

PREFIX = "atom"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


@dataclass
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += value
        self.count += 1

    def render(self, labels: str) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, n in zip(self.buckets, self.counts):
            cumulative += n
            lines.append(f'{self.name}_bucket{{{labels},le="{bound}"}} {cumulative}')
        lines.append(f'{self.name}_bucket{{{labels},le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum{{{labels}}} {self.total}")
        lines.append(f"{self.name}_count{{{labels}}} {self.count}")
        return lines


class ServerMetrics:
    """Request-level counters and latency histograms; `render(stats)` adds the core's gauges."""

    def __init__(self, model_name: str):
        self.labels = f'model_name="{_escape(model_name)}"'
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {}
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds", "Mean time per output token after the first.", TPOT_BUCKETS)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "End-to-end request latency.", E2E_BUCKETS)

    def observe_finished(self, state: RequestState, reason: str) -> None:
        """One engine request ended (`reason`: stop, length or abort)."""
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self.prompt_tokens += len(state.prompt_token_ids)
        self.generation_tokens += len(state.token_ids)
        if state.first_token_time is not None:
            self.ttft.observe(state.ttft)
        if reason != "abort":
            self.e2e.observe(state.latency)
            if len(state.token_ids) > 1:
                self.tpot.observe(state.tpot)

    def render(self, stats, num_api_requests: int) -> str:
        """Prometheus text; `stats` is the core's CoreStats (None when the core is gone)."""
        lines: list[str] = []

        def metric(name: str, kind: str, help: str, value, extra: str = "") -> None:
            full = f"{PREFIX}_{name}"
            lines.extend([f"# HELP {full} {help}", f"# TYPE {full} {kind}", f"{full}{{{self.labels}{extra}}} {value}"])

        if stats is not None:
            metric("num_requests_running", "gauge", "Requests in the running batch.", stats.num_running)
            metric("num_requests_waiting", "gauge", "Requests waiting to be scheduled.", stats.num_waiting)
            metric("kv_cache_blocks_total", "gauge", "KV cache blocks.", stats.num_kv_blocks)
            metric("kv_cache_blocks_free", "gauge", "Free KV cache blocks.", stats.num_free_blocks)
            metric("kv_cache_blocks_used", "gauge", "Used KV cache blocks.", stats.num_kv_blocks - stats.num_free_blocks)
            used = (stats.num_kv_blocks - stats.num_free_blocks) / max(stats.num_kv_blocks, 1)
            metric("kv_cache_usage_ratio", "gauge", "Fraction of KV cache blocks in use.", used)
            metric("prefix_cache_hit_rate", "gauge", "Prefix cache hit rate (tokens).", stats.prefix_hit_rate)
            metric("num_preemptions_total", "counter", "Preempted requests.", stats.num_preemptions)
        metric("engine_healthy", "gauge", "1 while the engine core process is alive.", int(stats is not None))
        metric("num_api_requests_in_flight", "gauge", "Engine requests the API process is serving.", num_api_requests)
        metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", self.prompt_tokens)
        metric("generation_tokens_total", "counter", "Generated tokens of finished requests.", self.generation_tokens)
        lines += [f"# HELP {PREFIX}_request_success_total Finished requests by finish reason.",
                  f"# TYPE {PREFIX}_request_success_total counter"]
        for reason, n in sorted(self.finished.items()):
            lines.append(f'{PREFIX}_request_success_total{{{self.labels},finished_reason="{reason}"}} {n}')
        for hist in (self.ttft, self.tpot, self.e2e):
            lines += hist.render(self.labels)
        return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
