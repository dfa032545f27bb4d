"""ServerMetrics through prometheus_client: names, types and values of a rendered scrape, parsed
by prometheus_client's own parser (the live server's /metrics is parsed in test_hardening)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from atom_core.engine.core import CoreStats
from atom_core.engine.output_processor import RequestState
from atom_core.sampling_params import SamplingParams
from atom_core.server.metrics import ServerMetrics, metric_name

STATS = CoreStats(num_running=2, num_waiting=1, num_kv_blocks=100, num_free_blocks=75, prefix_hit_rate=0.5,
                  num_preemptions=3)


def engine_view(stats=STATS, healthy=True, in_flight=4):
    return SimpleNamespace(latest_stats=stats, is_healthy=healthy, num_unfinished=in_flight)


def state(rid: str, arrival: float, first: float | None, finish: float | None, n_out: int) -> RequestState:
    s = RequestState(rid, None, [1, 2, 3], SamplingParams(max_tokens=16), None, arrival_time=arrival)
    s.first_token_time, s.finish_time, s.token_ids = first, finish, list(range(n_out))
    return s


def scrape(metrics: ServerMetrics) -> dict[str, dict]:
    """{family name: {"type": ..., samples: {(sample name, labels without model_name): value}}}"""
    out = {}
    for fam in text_string_to_metric_families(metrics.render().decode()):
        samples = {}
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            samples[(s.name, labels)] = s.value
            assert s.labels["model_name"] == "m"
        out[fam.name] = {"type": fam.type, **samples}
    return out


class TestRender:
    def test_core_gauges_from_the_pushed_stats(self):
        m = scrape(ServerMetrics("m", engine_view()))
        assert m["atom_num_requests_running"][("atom_num_requests_running", ())] == 2
        assert m["atom_num_requests_waiting"][("atom_num_requests_waiting", ())] == 1
        assert m["atom_kv_cache_blocks_used"][("atom_kv_cache_blocks_used", ())] == 25
        assert m["atom_kv_cache_usage_ratio"][("atom_kv_cache_usage_ratio", ())] == 0.25
        assert m["atom_prefix_cache_hit_rate"][("atom_prefix_cache_hit_rate", ())] == 0.5
        assert m["atom_num_preemptions"]["type"] == "counter"
        assert m["atom_num_preemptions"][("atom_num_preemptions_total", ())] == 3
        assert m["atom_engine_healthy"][("atom_engine_healthy", ())] == 1
        assert m["atom_num_api_requests_in_flight"][("atom_num_api_requests_in_flight", ())] == 4

    def test_dead_engine_has_no_core_gauges(self):
        m = scrape(ServerMetrics("m", engine_view(healthy=False)))
        assert m["atom_engine_healthy"][("atom_engine_healthy", ())] == 0
        assert "atom_num_requests_running" not in m

    def test_model_name_is_escaped(self):
        text = ServerMetrics('we"ird', engine_view()).render().decode()
        assert 'atom_engine_healthy{model_name="we\\"ird"} 1.0' in text

    def test_vllm_prefix(self):
        names = {f.name for f in text_string_to_metric_families(ServerMetrics("m", engine_view(), "vllm").render().decode())}
        assert {"vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds",
                "vllm:request_queue_time_seconds", "vllm:prompt_tokens"} <= names
        assert not any(n.startswith("atom_") for n in names)

    def test_unknown_prefix_is_rejected(self):
        with pytest.raises(ValueError, match="expected one of: atom, vllm"):
            metric_name("tgi", "x")


class TestObserve:
    def test_finished_request(self):
        metrics = ServerMetrics("m", engine_view())
        s = state("a", 10.0, 10.5, 12.5, 5)
        s.queue_time, s.prefill_time = 0.1, 0.3
        metrics.observe_finished(s, "length")
        m = scrape(metrics)
        assert m["atom_request_success"][("atom_request_success_total", (("finished_reason", "length"),))] == 1
        assert m["atom_prompt_tokens"][("atom_prompt_tokens_total", ())] == 3
        assert m["atom_generation_tokens"][("atom_generation_tokens_total", ())] == 5
        assert m["atom_time_to_first_token_seconds"][("atom_time_to_first_token_seconds_sum", ())] == pytest.approx(0.5)
        assert m["atom_e2e_request_latency_seconds"][("atom_e2e_request_latency_seconds_sum", ())] == pytest.approx(2.5)
        assert m["atom_request_queue_time_seconds"][("atom_request_queue_time_seconds_sum", ())] == pytest.approx(0.1)
        assert m["atom_request_prefill_time_seconds"][("atom_request_prefill_time_seconds_sum", ())] == pytest.approx(0.3)
        assert m["atom_request_decode_time_seconds"][("atom_request_decode_time_seconds_sum", ())] == pytest.approx(2.0)
        assert m["atom_request_inference_time_seconds"][("atom_request_inference_time_seconds_sum", ())] == pytest.approx(2.3)
        assert m["atom_request_aborted_before_first_token"][("atom_request_aborted_before_first_token_total", ())] == 0

    def test_abort_before_first_token_is_counted(self):
        metrics = ServerMetrics("m", engine_view())
        metrics.observe_finished(state("a", 1.0, None, None, 0), "abort")
        metrics.observe_finished(state("b", 1.0, 1.2, None, 2), "abort")  # had tokens: not counted
        m = scrape(metrics)
        assert m["atom_request_aborted_before_first_token"][("atom_request_aborted_before_first_token_total", ())] == 1
        assert m["atom_request_success"][("atom_request_success_total", (("finished_reason", "abort"),))] == 2
        assert m["atom_e2e_request_latency_seconds"][("atom_e2e_request_latency_seconds_count", ())] == 0

    def test_tpot_is_per_token_and_itl_per_delivery(self):
        metrics = ServerMetrics("m", engine_view())
        s = state("a", 0.0, None, None, 0)
        for now, n in ((1.0, 1), (1.1, 1), (1.5, 4)):  # first token, then gaps of 0.1 (1 token) and 0.4 (4 tokens)
            s.token_ids += [0] * n
            metrics.observe_progress(s, n, now)
        m = scrape(metrics)
        assert m["atom_inter_token_latency_seconds"][("atom_inter_token_latency_seconds_count", ())] == 2
        assert m["atom_inter_token_latency_seconds"][("atom_inter_token_latency_seconds_sum", ())] == pytest.approx(0.5)
        assert m["atom_time_per_output_token_seconds"][("atom_time_per_output_token_seconds_count", ())] == 5
        assert m["atom_time_per_output_token_seconds"][("atom_time_per_output_token_seconds_sum", ())] == pytest.approx(0.5)
        # every per-token observation is ~0.1 s (the 0.4 s gap is shared by its 4 tokens)
        buckets = m["atom_time_per_output_token_seconds"]
        assert buckets[("atom_time_per_output_token_seconds_bucket", (("le", "0.075"),))] == 0
        assert buckets[("atom_time_per_output_token_seconds_bucket", (("le", "0.15"),))] == 5
        metrics.observe_finished(s, "abort")
        assert not metrics._last_token_time
