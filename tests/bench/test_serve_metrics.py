"""Metric math on hand-built request outputs (no timing noise), spec parsing, and the table."""
from __future__ import annotations

import math

import numpy as np
import pytest
from rich.console import Console

from atom_core.bench.datasets import SampleRequest
from atom_core.bench.serve_client import RequestOutput
from atom_core.bench import serve_metrics


def _ok(ttft, itl, tokens=None, text=""):
    latency = ttft + sum(itl)
    return RequestOutput(generated_text=text, success=True, latency=latency, output_tokens=tokens,
                         ttft=ttft, itl=list(itl), prompt_len=0)


class TestCalculateMetrics:
    """Three requests, one failed; every number below is worked out by hand."""

    @pytest.fixture
    def case(self):
        inputs = [SampleRequest("a", 10, 5), SampleRequest("b", 20, 3), SampleRequest("c", 30, 4), SampleRequest("d", 7, 1)]
        outputs = [
            _ok(0.100, [0.05, 0.05, 0.05, 0.05], tokens=5),  # e2el 0.30, tpot 0.05
            _ok(0.300, [0.02, 0.02], tokens=3),  # e2el 0.34, tpot 0.02
            RequestOutput(success=False, error="HTTP 500: boom"),
            _ok(0.050, [], tokens=1),  # one token: no TPOT sample, TPOT 0 for goodput
        ]
        return inputs, outputs

    def test_counts_and_throughputs(self, case):
        metrics, output_lens = serve_metrics.calculate_metrics(*case, duration_s=2.0, tokenizer=None)
        assert output_lens == [5, 3, 0, 1]
        assert (metrics.completed, metrics.total_input, metrics.total_output) == (3, 37, 9)
        assert metrics.request_throughput == pytest.approx(1.5)
        assert metrics.output_throughput == pytest.approx(4.5)
        assert metrics.total_token_throughput == pytest.approx(23.0)
        assert metrics.request_goodput == 0.0  # no SLOs given

    def test_latency_stats(self, case):
        metrics, _ = serve_metrics.calculate_metrics(*case, duration_s=2.0, tokenizer=None, percentiles=(50, 99))
        ttft, tpot, itl, e2el = (metrics.latency[k] for k in ("ttft", "tpot", "itl", "e2el"))
        assert ttft.mean_ms == pytest.approx(150.0)
        assert ttft.median_ms == pytest.approx(100.0)
        assert ttft.std_ms == pytest.approx(np.std([100, 300, 50]))
        assert tpot.mean_ms == pytest.approx(35.0)  # (50 + 20) / 2: the 1-token request has no TPOT
        assert itl.mean_ms == pytest.approx(240.0 / 6)
        assert itl.median_ms == pytest.approx(50.0)
        assert e2el.mean_ms == pytest.approx((300 + 340 + 50) / 3)
        assert dict(ttft.percentiles_ms)[99.0] == pytest.approx(np.percentile([100, 300, 50], 99))

    @pytest.mark.parametrize(
        "slos, good",
        [({"ttft": 200}, 2), ({"tpot": 40}, 2), ({"ttft": 200, "tpot": 40}, 1), ({"e2el": 320}, 2), ({"ttft": 10}, 0)],
    )
    def test_goodput(self, case, slos, good):
        metrics, _ = serve_metrics.calculate_metrics(*case, duration_s=2.0, tokenizer=None, goodput=slos)
        assert metrics.request_goodput == pytest.approx(good / 2.0)

    def test_counts_tokens_by_retokenizing_without_usage(self, byte_bpe):
        text = " hello world hello"
        metrics, lens = serve_metrics.calculate_metrics([SampleRequest("p", 3, 8)], [_ok(0.1, [0.1, 0.1], text=text)],
                                                       1.0, byte_bpe)
        assert lens == [len(byte_bpe(text, add_special_tokens=False).input_ids)]
        with pytest.raises(ValueError, match="tokenizer is needed"):
            serve_metrics.calculate_metrics([SampleRequest("p", 3, 8)], [_ok(0.1, [0.1], text=text)], 1.0, None)

    def test_all_failed_gives_zeros(self):
        metrics, lens = serve_metrics.calculate_metrics([SampleRequest("p", 3, 8)], [RequestOutput(error="x")],
                                                       1.0, None)
        assert (metrics.completed, lens, metrics.latency["ttft"].mean_ms) == (0, [0], 0.0)


class TestResultKeys:
    def test_vllm_key_names(self):
        outputs = [_ok(0.1, [0.05], tokens=2)]
        metrics, _ = serve_metrics.calculate_metrics([SampleRequest("p", 3, 2)], outputs, 1.0, None,
                                                    percentiles=(50, 99.9))
        keys = set(serve_metrics.latency_result(metrics, ("ttft", "e2el")))
        assert keys == {
            "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p50_ttft_ms", "p99.9_ttft_ms",
            "mean_e2el_ms", "median_e2el_ms", "std_e2el_ms", "p50_e2el_ms", "p99.9_e2el_ms",
        }
        assert serve_metrics.throughput_result(metrics, has_goodput=False)["request_goodput"] is None
        assert serve_metrics.throughput_result(metrics, has_goodput=True)["request_goodput"] == 0.0


class TestParsing:
    def test_goodput_spellings(self):
        expected = {"ttft": 200.0, "tpot": 50.0}
        assert serve_metrics.parse_goodput("ttft:200 tpot:50") == expected
        assert serve_metrics.parse_goodput(["ttft:200", "tpot:50"]) == expected
        assert serve_metrics.parse_goodput("ttft:200,tpot:50") == expected
        assert serve_metrics.parse_goodput(None) == {} and serve_metrics.parse_goodput("") == {}

    @pytest.mark.parametrize(
        "spec, match",
        [("ttft=200", "bad --goodput item 'ttft=200'"), ("ttft:abc", "bad --goodput item"),
         ("itl:5", "unknown --goodput metric 'itl'; expected one of: ttft, tpot, e2el"),
         ("ttft:-1", "must be >= 0")],
    )
    def test_goodput_errors(self, spec, match):
        with pytest.raises(ValueError, match=match):
            serve_metrics.parse_goodput(spec)

    def test_percentiles(self):
        assert serve_metrics.parse_percentile_metrics("ttft, e2el") == ("ttft", "e2el")
        assert serve_metrics.parse_metric_percentiles("50,90,99.9") == (50.0, 90.0, 99.9)
        for bad, match in [("5x", "bad percentile '5x'"), ("101", "out of range"), ("", "bad percentile")]:
            with pytest.raises(ValueError, match=match):
                serve_metrics.parse_metric_percentiles(bad)
        with pytest.raises(ValueError, match="unknown percentile metric 'foo'"):
            serve_metrics.parse_percentile_metrics("ttft,foo")


def test_table_shows_failures_and_selected_metrics():
    result = {
        "num_prompts": 4, "completed": 3, "duration": 2.0, "total_input_tokens": 37, "total_output_tokens": 9,
        "request_throughput": 1.5, "request_goodput": None, "output_throughput": 4.5,
        "total_token_throughput": 23.0, "mean_ttft_ms": 150.0, "median_ttft_ms": 100.0, "std_ttft_ms": 1.0,
        "p99_ttft_ms": 296.0, "p99.9_ttft_ms": math.pi,
    }
    console = Console(record=True, width=100)
    console.print(serve_metrics.result_table(result))
    text = console.export_text()
    assert "Failed requests" in text and "P99 TTFT (ms)" in text and "P99.9 TTFT (ms)" in text
    assert "TPOT" not in text and "goodput" not in text
