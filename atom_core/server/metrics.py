"""/metrics: Prometheus metrics of the server, through prometheus_client.

Everything is served from the API process's registry, so a scrape never waits on the core:
- request metrics (counters, latency histograms) are observed here as requests advance and end;
  TTFT and end-to-end latency count from the HTTP request's arrival at the API process;
- the core's gauges (running/waiting, KV blocks, prefix-cache hit rate, preemptions) are the
  last CoreStats it pushed (AsyncEngine.latest_stats), read by `_CoreCollector` at scrape time.

Names: `atom_<name>` by default; `prefix="vllm"` gives vLLM's `vllm:<name>` (and vLLM's
spelling where ours differs, VLLM_RENAMES), so existing dashboards work. Every series carries
a `model_name` label.
"""
from __future__ import annotations

from typing import Literal, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from atom_core.engine.output_processor import RequestState

MetricsPrefix = Literal["atom", "vllm"]
METRICS_PREFIXES: tuple[str, ...] = ("atom", "vllm")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0)

# Our name -> vLLM's, where they differ (the rest match vLLM's V1 names).
VLLM_RENAMES = {"kv_cache_usage_ratio": "kv_cache_usage_perc"}


class EngineView(Protocol):
    """What the metrics read from the engine client (AsyncEngine) at scrape time."""

    latest_stats: object  # CoreStats or None
    is_healthy: bool
    num_unfinished: int


def metric_name(prefix: str, name: str) -> str:
    if prefix == "vllm":
        return f"vllm:{VLLM_RENAMES.get(name, name)}"
    if prefix == "atom":
        return f"atom_{name}"
    raise ValueError(f"unknown metrics prefix {prefix!r}; expected one of: {', '.join(METRICS_PREFIXES)}")


class ServerMetrics:
    """The server's registry. Call `observe_progress` after each step's update of a request
    (AsyncEngine.on_progress), `observe_finished` once when a request ends, `render` to scrape."""

    def __init__(self, model_name: str, engine: EngineView | None = None, prefix: MetricsPrefix = "atom"):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        name = lambda n: metric_name(prefix, n)  # noqa: E731
        self.registry.register(_CoreCollector(name, model_name, engine))

        def counter(n: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            c = Counter(name(n), doc, ("model_name", *labels), registry=self.registry)
            return c if labels else c.labels(model_name)

        def histogram(n: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name(n), doc, ("model_name",), registry=self.registry, buckets=buckets).labels(model_name)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished requests.")
        self._finished = counter("request_success", "Finished requests by finish reason (stop, length, abort).",
                                 ("finished_reason",))
        self.aborted_before_first_token = counter(
            "request_aborted_before_first_token", "Requests that ended (client gone, error) before their first token.")
        self.ttft = histogram("time_to_first_token_seconds",
                              "Time to first token, from the request's arrival at the API process.", TTFT_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds",
                              "Time per output token after the first (one observation per token).", TPOT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Time between successive output deliveries of a request.", TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "End-to-end request latency, from the request's arrival at the API process.", E2E_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Time a request waited in the core's queue before its first schedule.", PHASE_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "Time from a request's first schedule to its first token.", PHASE_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds",
                                     "Time from a request's first token to its last.", PHASE_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds",
                                        "Prefill plus decode time of a request.", PHASE_BUCKETS)
        self._last_token_time: dict[str, float] = {}

    def observe_progress(self, state: RequestState, num_new_tokens: int, now: float) -> None:
        """A step's update of one request: inter-token latency and per-token TPOT."""
        if num_new_tokens <= 0:
            return
        last = self._last_token_time.get(state.request_id)
        if last is not None:
            gap = now - last
            self.itl.observe(gap)
            for _ in range(num_new_tokens):  # a step may deliver several tokens (speculation, windows)
                self.tpot.observe(gap / num_new_tokens)
        if state.finished:
            self._last_token_time.pop(state.request_id, None)
        else:
            self._last_token_time[state.request_id] = now

    def observe_finished(self, state: RequestState, reason: str) -> None:
        """One engine request ended (`reason`: stop, length or abort)."""
        self._last_token_time.pop(state.request_id, None)
        self._finished.labels(self.model_name, reason).inc()
        self.prompt_tokens.inc(len(state.prompt_token_ids))
        self.generation_tokens.inc(len(state.token_ids))
        if state.first_token_time is None:
            if reason == "abort":
                self.aborted_before_first_token.inc()
        else:
            self.ttft.observe(state.ttft)
        if reason == "abort":
            return
        self.e2e.observe(state.latency)
        if state.queue_time is not None:
            self.queue_time.observe(state.queue_time)
        if state.first_token_time is not None and state.finish_time is not None:
            decode = state.finish_time - state.first_token_time
            self.decode_time.observe(decode)
            if state.prefill_time is not None:
                self.prefill_time.observe(state.prefill_time)
                self.inference_time.observe(state.prefill_time + decode)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _CoreCollector:
    """The engine's gauges at scrape time, from the core's last pushed CoreStats."""

    def __init__(self, name, model_name: str, engine: EngineView | None):
        self.name, self.model_name, self.engine = name, model_name, engine

    def describe(self):
        return []  # the families depend on whether the core has reported yet

    def collect(self):
        engine = self.engine
        stats = engine.latest_stats if engine is not None and engine.is_healthy else None

        def family(kind, n: str, doc: str, value):
            fam = kind(self.name(n), doc, labels=["model_name"])
            fam.add_metric([self.model_name], value)
            return fam

        yield family(GaugeMetricFamily, "engine_healthy", "1 while the engine core process is alive.", int(stats is not None))
        yield family(GaugeMetricFamily, "num_api_requests_in_flight", "Engine requests the API process is serving.",
                     engine.num_unfinished if engine is not None else 0)
        if stats is None:
            return
        used = stats.num_kv_blocks - stats.num_free_blocks
        yield family(GaugeMetricFamily, "num_requests_running", "Requests in the running batch.", stats.num_running)
        yield family(GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting)
        yield family(GaugeMetricFamily, "kv_cache_blocks_total", "KV cache blocks.", stats.num_kv_blocks)
        yield family(GaugeMetricFamily, "kv_cache_blocks_free", "Free KV cache blocks.", stats.num_free_blocks)
        yield family(GaugeMetricFamily, "kv_cache_blocks_used", "Used KV cache blocks.", used)
        yield family(GaugeMetricFamily, "kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0-1).",
                     used / max(stats.num_kv_blocks, 1))
        yield family(GaugeMetricFamily, "prefix_cache_hit_rate", "Prefix cache hit rate (tokens, since start).",
                     stats.prefix_hit_rate)
        yield family(GaugeMetricFamily, "engine_memory_bytes", "Memory the engine core holds: the CUDA caching "
                     "allocator's reserved bytes on a GPU, the core process's resident set on the CPU.",
                     stats.memory_bytes)
        # Counters the core keeps: add more here from CoreStats (e.g. speculative decoding's
        # draft and accepted tokens), one CounterMetricFamily each.
        yield family(CounterMetricFamily, "num_preemptions", "Preempted requests.", stats.num_preemptions)
        yield from self._spec_decode(stats, family)

    def _spec_decode(self, stats, family):
        """Speculative decoding counters, named as vLLM's spec_decode_* (present with --method)."""
        if not stats.spec_decode_num_drafts and not stats.spec_decode_accepted_per_position:
            return
        yield family(CounterMetricFamily, "spec_decode_num_drafts", "Draft proposals verified.",
                     stats.spec_decode_num_drafts)
        yield family(CounterMetricFamily, "spec_decode_num_draft_tokens", "Draft tokens verified.",
                     stats.spec_decode_num_draft_tokens)
        yield family(CounterMetricFamily, "spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                     stats.spec_decode_num_accepted_tokens)
        per_position = CounterMetricFamily(self.name("spec_decode_num_accepted_tokens_per_pos"),
                                           "Draft tokens accepted, by position in the draft.",
                                           labels=["model_name", "position"])
        for position, count in enumerate(stats.spec_decode_accepted_per_position):
            per_position.add_metric([self.model_name, str(position)], count)
        yield per_position
