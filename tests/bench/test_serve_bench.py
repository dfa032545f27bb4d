"""The serving benchmark against a scripted SSE server on 127.0.0.1 (see conftest.FakeServer).

Timed values are compared to the script with tolerances: the client and the server share a
(busy, 2-core) CI machine. Gaps between chunks (ITL, TPOT) are checked within +-`TOL_S`. Times
from the request's start (TTFT, E2EL) also hold the request's trip to the server, which a busy
machine stretches; they can only be late, never early, so they are checked within
[expected, expected + `LATE_S`]. A timed check gets `TIMED_ATTEMPTS` runs: one run on an
overloaded machine can be late, while a wrong definition fails every run.
"""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from atom_core.bench.datasets import DatasetConfig
from atom_core.bench.serve_bench import (
    BenchmarkError,
    ServeBenchConfig,
    arrival_times,
    default_result_filename,
    report,
    run_benchmark,
    save_result,
)
from atomctl.bench import bench_app

TOL_S = 0.02
LATE_S = 0.04
TIMED_ATTEMPTS = 3
VLLM_KEYS = [
    "date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate", "burstiness", "max_concurrency",
    "duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
    "output_throughput", "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls", "generated_texts",
    "errors", "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
    "std_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "std_itl_ms", "p99_itl_ms",
]
SCRIPTED = [("script:ttft=0.10,itl=0.05 first", 5), ("script:ttft=0.30,itl=0.02 second", 3)]


def _custom_cfg(server, tmp_path, prompts, **kwargs) -> ServeBenchConfig:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "output_len": n}) + "\n" for p, n in prompts))
    kwargs.setdefault("model", "fake-model")
    return ServeBenchConfig(
        base_url=server.base_url, dataset=DatasetConfig(name="custom", path=str(path)),
        num_prompts=len(prompts), show_progress=False, **kwargs,
    )


def _run(cfg, tokenizer, console=None):
    return run_benchmark(cfg, tokenizer=tokenizer, console=console or Console(file=io.StringIO()))


def _close(actual, expected, tol=TOL_S):
    return np.allclose(actual, expected, atol=tol, rtol=0)


def _late(actual, expected):
    """actual is expected plus a non-negative delay below LATE_S (2 ms slack for clock reads)."""
    delay = np.subtract(actual, expected)
    return bool(np.all(delay > -0.002) and np.all(delay < LATE_S))


def _timed(run_and_check):
    for attempt in range(TIMED_ATTEMPTS):
        try:
            return run_and_check()
        except AssertionError:
            if attempt == TIMED_ATTEMPTS - 1:
                raise


class TestScriptedMetrics:
    """Request A: 5 tokens at 0.10, 0.15, ..., 0.30 s; request B: 3 tokens at 0.30, 0.32, 0.34 s; one at a time."""

    @pytest.mark.parametrize("backend", ["vllm", "openai-chat"])
    def test_metrics_match_hand_computed_values(self, fake_server, tmp_path, byte_bpe, backend):
        cfg = _custom_cfg(fake_server, tmp_path, SCRIPTED, backend=backend, max_concurrency=1, goodput="ttft:200",
                          percentile_metrics="ttft,tpot,itl,e2el", metric_percentiles="50,99")
        result = _timed(lambda: self._check_scripted(fake_server, _run(cfg, byte_bpe)))
        assert result["generated_texts"] == [fake_server.token_text * 5, fake_server.token_text * 3]

    @staticmethod
    def _check_scripted(fake_server, result):
        assert list(result)[: len(VLLM_KEYS) - 12] == VLLM_KEYS[:-12]  # vLLM's order up to the detail lists
        assert result["completed"] == 2 and result["errors"] == ["", ""]
        assert result["total_output_tokens"] == 8 and result["output_lens"] == [5, 3]
        # The chat server sends a role-only chunk at once; it must not count as the first token.
        assert _late(result["ttfts"], [0.10, 0.30]), result["ttfts"]
        assert _close(result["itls"][0], [0.05] * 4) and _close(result["itls"][1], [0.02] * 2)
        assert _late(result["mean_ttft_ms"] / 1000, 0.20) and _close(result["std_ttft_ms"] / 1000, 0.10)
        assert _close(result["mean_tpot_ms"] / 1000, 0.035)  # (0.20 / 4 + 0.04 / 2) / 2
        assert _close(result["mean_itl_ms"] / 1000, 0.04) and _close(result["median_itl_ms"] / 1000, 0.05)
        assert _late(result["mean_e2el_ms"] / 1000, 0.32) and _late(result["p50_e2el_ms"] / 1000, 0.32)
        duration = result["duration"]
        assert 0.64 <= duration <= 0.64 + 0.15  # serial: 0.30 + 0.34 s plus request overheads
        assert result["request_throughput"] == pytest.approx(2 / duration)
        assert result["output_throughput"] == pytest.approx(8 / duration)
        assert result["total_token_throughput"] == pytest.approx((result["total_input_tokens"] + 8) / duration)
        assert result["total_input_tokens"] == sum(result["input_lens"])
        assert result["request_goodput"] == pytest.approx(1 / duration)  # only A has TTFT <= 200 ms
        return result

    def test_tgi_backend(self, fake_server, tmp_path, byte_bpe):
        cfg = _custom_cfg(fake_server, tmp_path, SCRIPTED, backend="tgi", max_concurrency=1)

        def check():
            result = _run(cfg, byte_bpe)
            assert result["completed"] == 2 and result["output_lens"] == [5, 3]
            assert _late(result["ttfts"], [0.10, 0.30]) and _close(result["itls"][0], [0.05] * 4)

        _timed(check)
        assert fake_server.stats()["payloads"][-1]["parameters"]["max_new_tokens"] == 3

    def test_counts_tokens_by_retokenizing_without_usage(self, fake_server, tmp_path, byte_bpe):
        fake_server.configure(send_usage=False)
        result = _run(_custom_cfg(fake_server, tmp_path, SCRIPTED, max_concurrency=1), byte_bpe)
        expected = [len(byte_bpe(fake_server.token_text * n, add_special_tokens=False).input_ids) for n in (5, 3)]
        assert result["output_lens"] == expected


class TestLoadShape:
    def _random_cfg(self, server, **kwargs) -> ServeBenchConfig:
        dataset = DatasetConfig(random_input_len=16, random_output_len=5)
        return ServeBenchConfig(base_url=server.base_url, model="fake-model", dataset=dataset,
                                show_progress=False, **kwargs)

    def test_max_concurrency_is_never_exceeded(self, fake_server, byte_bpe):
        result = _run(self._random_cfg(fake_server, num_prompts=12, max_concurrency=3), byte_bpe)
        assert result["completed"] == 12 and result["max_concurrency"] == 3
        assert fake_server.stats()["max_active"] == 3

    def test_without_a_limit_all_requests_are_in_flight(self, fake_server, byte_bpe):
        fake_server.configure(ttft_s=0.1)
        _run(self._random_cfg(fake_server, num_prompts=12), byte_bpe)
        assert fake_server.stats()["max_active"] == 12

    def test_arrivals_follow_the_seeded_schedule(self, fake_server, byte_bpe):
        cfg = self._random_cfg(fake_server, num_prompts=10, request_rate=20.0, burstiness=1.0, seed=5)

        def check():
            fake_server.configure()
            result = _run(cfg, byte_bpe)
            arrivals = np.array(fake_server.stats()["arrivals"][1:])  # [0] is the initial test request
            assert _close(arrivals - arrivals[0], arrival_times(10, 20.0, 1.0, seed=5))
            assert result["request_rate"] == 20.0 and result["burstiness"] == 1.0

        _timed(check)

    def test_warmups_and_request_options_reach_the_server(self, fake_server, byte_bpe):
        cfg = self._random_cfg(fake_server, num_prompts=4, num_warmups=3, ignore_eos=True,
                               served_model_name="served", extra_body={"temperature": 0.7})
        _run(cfg, byte_bpe)
        payloads = fake_server.stats()["payloads"]
        assert len(payloads) == 1 + 3 + 4
        last = payloads[-1]
        assert last["ignore_eos"] is True and last["model"] == "served" and last["temperature"] == 0.7
        assert last["stream_options"] == {"include_usage": True} and last["max_tokens"] == 5


class TestArrivalTimes:
    def test_gamma_interarrivals(self):
        gaps = np.diff(arrival_times(20001, 50.0, 1.0, seed=0))
        assert gaps.mean() == pytest.approx(1 / 50, rel=0.05)
        assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # Poisson: CV 1
        bursty = np.diff(arrival_times(20001, 50.0, 4.0, seed=0))
        assert bursty.mean() == pytest.approx(1 / 50, rel=0.05)
        assert bursty.std() / bursty.mean() == pytest.approx(0.5, rel=0.05)  # CV = 1 / sqrt(shape)

    def test_inf_rate_and_seed(self):
        assert not arrival_times(5, float("inf"), 1.0, seed=0).any()
        assert np.array_equal(arrival_times(5, 3.0, 1.0, 1), arrival_times(5, 3.0, 1.0, 1))


class TestFailures:
    def test_failed_requests_are_counted_and_reported(self, fake_server, tmp_path, byte_bpe):
        prompts = [("fine one", 4), ("FAIL500", 4), ("FAILMID", 6), ("ERRCHUNK", 4), ("NOCHUNK", 4), ("fine two", 4)]
        result = _run(_custom_cfg(fake_server, tmp_path, prompts, max_concurrency=2), byte_bpe)
        assert result["completed"] == 2 and result["output_lens"] == [4, 0, 0, 0, 0, 4]
        errors = result["errors"]
        assert errors[0] == errors[5] == ""
        assert errors[1].startswith("HTTP 500") and "scripted failure" in errors[1]
        assert errors[2]  # the connection was cut: an httpx protocol error
        assert errors[3] == "error in stream: boom"
        assert "never received a token chunk" in errors[4]
        console = Console(record=True, width=200, file=io.StringIO())
        report(result, console)
        text = console.export_text()
        assert "WARNING: 4 of 6 requests FAILED" in text and "1 x HTTP 500" in text

    def test_failing_initial_request_stops_the_benchmark(self, fake_server, tmp_path, byte_bpe):
        with pytest.raises(BenchmarkError, match="initial test request .* failed: HTTP 500"):
            _run(_custom_cfg(fake_server, tmp_path, [("FAIL500", 4)]), byte_bpe)


class TestServerFeatures:
    def test_profile_brackets_the_timed_run(self, fake_server, tmp_path, byte_bpe):
        _run(_custom_cfg(fake_server, tmp_path, [("a", 2), ("b", 2), ("c", 2)], profile=True), byte_bpe)
        assert fake_server.stats()["profile_calls"] == [["start_profile", 1], ["stop_profile", 4]]

    def test_profile_without_profiler_is_an_error(self, fake_server, tmp_path, byte_bpe):
        fake_server.configure(has_profiler=False)
        with pytest.raises(BenchmarkError, match="--profile: POST .*/start_profile returned HTTP 404"):
            _run(_custom_cfg(fake_server, tmp_path, [("a", 2)], profile=True), byte_bpe)

    def test_model_defaults_to_the_servers_first(self, fake_server, tmp_path, byte_bpe):
        result = _run(_custom_cfg(fake_server, tmp_path, [("a", 2)], model=None), byte_bpe)
        assert result["model_id"] == "fake-model" and fake_server.stats()["payloads"][-1]["model"] == "fake-model"


class TestConfig:
    @pytest.mark.parametrize(
        "kwargs, match",
        [
            ({"backend": "foo"}, "unknown backend 'foo'; expected one of: openai, vllm"),
            ({"backend": "openai-chat", "endpoint": "/v1/completions"}, "needs a chat endpoint"),
            ({"backend": "vllm", "endpoint": "/v1/chat/completions"}, "needs a completions endpoint"),
            ({"request_rate": 0.0}, "--request-rate must be > 0"),
            ({"burstiness": 0.0}, "--burstiness must be > 0"),
            ({"max_concurrency": 0}, "--max-concurrency must be >= 1"),
            ({"base_url": "localhost:8000"}, "must start with http"),
        ],
    )
    def test_rejects_bad_values(self, kwargs, match):
        with pytest.raises(ValueError, match=match):
            ServeBenchConfig(**kwargs)

    def test_default_endpoints(self):
        assert ServeBenchConfig(backend="openai-chat").api_url == "http://127.0.0.1:8000/v1/chat/completions"
        assert ServeBenchConfig(backend="atom", base_url="http://h:1/").api_url == "http://h:1/v1/completions"
        assert ServeBenchConfig(backend="tgi").endpoint == "/generate_stream"


def test_saved_result_has_vllm_name_and_keys(fake_server, tmp_path, byte_bpe):
    result = _run(_custom_cfg(fake_server, tmp_path, SCRIPTED, max_concurrency=2), byte_bpe)
    path = save_result(result, tmp_path / "out")
    assert path.name == default_result_filename(result)
    assert path.name.startswith("vllm-infqps-concurrency2-fake-model-") and path.suffix == ".json"
    saved = json.loads(path.read_text())
    assert set(VLLM_KEYS) <= set(saved) and saved["request_rate"] == "inf"


# --- CLI --------------------------------------------------------------------------------


def _cli() -> typer.Typer:
    app = typer.Typer()
    app.add_typer(bench_app, name="bench")
    return app


class TestServeCli:
    def test_runs_and_saves_result(self, fake_server, tmp_path, byte_bpe_dir):
        out = tmp_path / "results"
        args = ["bench", "serve", "--base-url", fake_server.base_url, "--model", "fake-model",
                "--tokenizer", str(byte_bpe_dir), "--random-input-len", "12", "--random-output-len", "3",
                "--num-prompts", "5", "--max-concurrency", "2", "--goodput", "ttft:500", "tpot:100",
                "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(out),
                "--result-filename", "r.json", "--metadata", "gpu=none", "--disable-tqdm"]
        result = CliRunner().invoke(_cli(), args)
        assert result.exit_code == 0, result.output
        assert "Serving Benchmark Result" in result.output and "Request goodput" in result.output
        saved = json.loads((out / "r.json").read_text())
        assert set(VLLM_KEYS) <= set(saved) and saved["gpu"] == "none"
        assert saved["completed"] == 5 and saved["request_goodput"] > 0 and "p50_ttft_ms" in saved
        assert all(n == 12 for n in saved["input_lens"])

    @pytest.mark.parametrize(
        "args, message",
        [
            (["--goodput", "ttft=200"], "bad --goodput item 'ttft=200'"),
            (["--goodput", "foo:1"], "unknown --goodput metric 'foo'"),
            (["--dataset-name", "bogus"], "unknown dataset 'bogus'; expected one of: random, sharegpt, custom"),
            (["--dataset-name", "sharegpt"], "dataset 'sharegpt' needs --dataset-path"),
            (["--dataset-name", "custom", "--dataset-path", "/no/such.jsonl"], "does not exist"),
            (["--metric-percentiles", "99,abc"], "bad percentile 'abc'"),
            (["--metric-percentiles", "120"], "percentile 120 is out of range"),
            (["--percentile-metrics", "ttft,latency"], "unknown percentile metric 'latency'"),
            (["--backend", "sglang"], "unknown backend 'sglang'"),
            (["--backend", "openai-chat", "--endpoint", "/v1/completions"], "needs a chat endpoint"),
            (["--request-rate", "0"], "--request-rate must be > 0"),
            (["--num-prompts", "0"], "--num-prompts must be >= 1"),
            (["--random-range-ratio", "1.5"], "--random-range-ratio must be in [0, 1)"),
            (["--metadata", "novalue"], "bad --metadata 'novalue'"),
            (["stray"], "unexpected argument(s): stray"),
        ],
    )
    def test_bad_flags_give_one_line_errors(self, args, message):
        base = ["bench", "serve", "--model", "m", "--base-url", "http://127.0.0.1:9"]
        result = CliRunner().invoke(_cli(), base + args)
        assert result.exit_code != 0
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output

    def test_unreachable_server_is_a_one_line_error(self):
        # Checked before the tokenizer loads: "m" is no tokenizer, and loading it would hit the network.
        result = CliRunner().invoke(_cli(), ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m"])
        assert result.exit_code == 1
        assert result.output.strip().startswith("error: cannot reach the server at http://127.0.0.1:9: ConnectError")
        assert len(result.output.strip().splitlines()) == 1

    def test_missing_tokenizer_is_a_one_line_error(self, fake_server):
        args = ["bench", "serve", "--base-url", fake_server.base_url, "--tokenizer", "/no/such/tokenizer"]
        result = CliRunner().invoke(_cli(), args)
        assert result.exit_code == 1
        assert result.output.strip().splitlines()[-1].startswith(
            "error: cannot find the tokenizer of model 'fake-model': '/no/such/tokenizer' is not a local directory")
