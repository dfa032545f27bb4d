"""`atomctl bench api-overhead`: the stand-in core, the measurement on a tiny model, the CLI."""
from __future__ import annotations

import json
import time

import pytest
from typer.testing import CliRunner

from atom_core.bench.api_overhead import ApiOverheadConfig, result_table
from atom_core.bench.stand_in_core import StandInExecutor
from atom_core.config import EngineConfig
from atom_core.sampling_params import SamplingParams
from atom_core.scheduler_output import NewRequest, SchedulerOutput
from atomctl.bench_api_overhead import parse_concurrencies
from atomctl.main import app

RUN_KEYS = {"concurrency", "num_requests", "output_tokens", "output_tok_s", "num_chunks", "tokens_per_chunk",
            "sample_to_write_p50_ms", "sample_to_write_p99_ms", "hop_p50_ms", "hop_p99_ms",
            "api_cpu_us_per_token", "core_cpu_us_per_token",
            "client_cpu_us_per_token", "median_ttft_ms", "median_tpot_ms", "steps_per_s_per_stream"}


class TestStandInExecutor:
    def _executor(self, tiny_llama, step_s: float) -> StandInExecutor:
        return StandInExecutor(EngineConfig.from_kwargs(tiny_llama, device="cpu"), 100, 512, step_s)

    def test_samples_only_when_a_request_reaches_its_last_token(self, tiny_llama):
        ex = self._executor(tiny_llama, 0.0)
        out = SchedulerOutput(new_requests=[NewRequest("a", [1] * 10, [], SamplingParams(), 0)])
        out.add("a", 6, 0)  # a prefill chunk short of the prompt's end
        assert ex.resolve(ex.launch(out)).sampled == [[]]
        out = SchedulerOutput()
        out.add("a", 4, 6)
        first = ex.resolve(ex.launch(out)).sampled
        assert len(first) == 1 and len(first[0]) == 1 and 0 <= first[0][0] < 100
        out = SchedulerOutput()
        out.add("a", 1, 10)  # decode of the token just sampled
        assert len(ex.resolve(ex.launch(out)).sampled[0]) == 1

    def test_steps_take_step_time_back_to_back(self, tiny_llama):
        ex = self._executor(tiny_llama, 0.02)
        start = time.monotonic()
        handles = []
        for i in range(3):
            out = SchedulerOutput(new_requests=[NewRequest(f"r{i}", [1, 2], [], SamplingParams(), 0)])
            out.add(f"r{i}", 2, 0)
            handles.append(ex.launch(out))
        assert time.monotonic() - start < 0.02  # launch never waits for the device
        for handle in handles:
            ex.resolve(handle)
        assert time.monotonic() - start >= 0.06  # three steps, one after another


def test_the_stand_in_core_refuses_what_it_cannot_produce(tiny_llama):
    from atom_core.bench.stand_in_core import StandInCore
    from atom_core.multimodal.inputs import MultimodalItem

    core = StandInCore(EngineConfig.from_kwargs(tiny_llama, device="cpu"), step_s=0.0)
    for params in (SamplingParams(logprobs=2), SamplingParams(prompt_logprobs=1)):
        with pytest.raises(ValueError, match="stand-in core"):
            core.add_request("r", [1, 2, 3], params)
    image = MultimodalItem(offset=1, length=1, content_hash="h", data={})
    with pytest.raises(ValueError, match="no images"):
        core.add_request("r", [1, 2, 3], SamplingParams(), (image,))
    core.add_request("ok", [1, 2, 3], SamplingParams(max_tokens=2))
    assert core.has_unfinished()


class TestConfig:
    @pytest.mark.parametrize("kwargs, message", [
        ({"concurrencies": ()}, "--concurrency"), ({"concurrencies": (4, 0)}, "--concurrency"),
        ({"step_ms": -1.0}, "--step-ms"), ({"step_ms": float("nan")}, "--step-ms"),
        ({"input_len": 0}, "--input-len"), ({"output_len": 0}, "--output-len"),
        ({"requests_per_stream": 0}, "--requests-per-stream"),
        ({"max_num_batched_tokens": 0}, "--max-num-batched-tokens"),
    ])
    def test_rejects_bad_values(self, kwargs, message):
        with pytest.raises(ValueError, match=message):
            ApiOverheadConfig(**kwargs)

    def test_parses_concurrency_lists(self):
        assert parse_concurrencies("64,256") == (64, 256)
        assert parse_concurrencies("8") == (8,)
        for bad in ("", "a,b", "1.5"):
            with pytest.raises(ValueError, match="--concurrency"):
                parse_concurrencies(bad)


class TestCli:
    def test_measures_each_concurrency_on_a_tiny_model_and_writes_the_json(self, tiny_llama, tmp_path):
        """The whole measurement through the CLI (one server start for both): its flags reach the config,
        each concurrency gets a run of its own, the JSON holds what run_api_overhead returned."""
        out = tmp_path / "r.json"
        result = CliRunner().invoke(app, ["bench", "api-overhead", "--model", str(tiny_llama), "--concurrency", "2,4",
                                          "--step-ms", "2", "--input-len", "16", "--output-len", "8",
                                          "--requests-per-stream", "1", "--max-num-batched-tokens", "64",
                                          "--log-dir", str(tmp_path), "--output-json", str(out)])
        assert result.exit_code == 0, result.output
        data = json.loads(out.read_text())
        assert data["step_ms"] == 2.0 and data["input_len"] == 16 and data["output_len"] == 8
        assert (tmp_path / "api_overhead_server.log").exists()
        assert [run["concurrency"] for run in data["runs"]] == [2, 4]
        for run in data["runs"]:
            assert RUN_KEYS <= set(run)
            assert run["num_requests"] == run["concurrency"] and run["output_tokens"] == run["concurrency"] * 8
            assert run["num_chunks"] >= run["concurrency"]  # at least one written chunk per request
            assert run["client_events"] == run["num_chunks"]  # every chunk the server wrote arrived
            assert 0 < run["sample_to_write_p50_ms"] <= run["sample_to_write_p99_ms"] < 10_000
            # the hop is a part of each chunk's latency, so of every percentile too
            assert 0 <= run["hop_p50_ms"] <= run["sample_to_write_p50_ms"]
            assert run["hop_p99_ms"] <= run["sample_to_write_p99_ms"]
            assert run["api_cpu_us_per_token"] >= 0  # CPU times tick in 10 ms: a run this small may read 0
        assert "c4" in str(result_table(data).columns[-1].header)

    @pytest.mark.parametrize("args, message", [
        (["--concurrency", "x"], "bad --concurrency"), (["--step-ms", "-2"], "--step-ms must be >= 0"),
        (["--output-len", "0"], "--output-len must be >= 1"),
    ])
    def test_bad_flags_fail_with_one_line(self, args, message):
        result = CliRunner().invoke(app, ["bench", "api-overhead", *args])
        assert result.exit_code == 1
        assert message in result.output

    def test_a_missing_model_fails_before_any_server_starts(self, tmp_path):
        result = CliRunner().invoke(app, ["bench", "api-overhead", "--model", str(tmp_path / "nope"),
                                          "--log-dir", str(tmp_path)])
        assert result.exit_code == 1
        assert "error:" in result.output and not (tmp_path / "api_overhead_server.log").exists()


def test_the_server_writes_its_cprofile_on_sigterm(tiny_llama, tmp_path):
    import pstats
    import signal
    import subprocess
    import sys

    import httpx

    out = tmp_path / "api.prof"
    proc = subprocess.Popen([sys.executable, "-m", "atom_core.bench.api_overhead_server", "--model", str(tiny_llama),
                             "--step-ms", "1", "--max-num-seqs", "4", "--cprofile", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        port = int(proc.stdout.readline().split()[1])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        body = {"prompt": "hello", "max_tokens": 3, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200 and sum(1 for _ in r.iter_lines()) > 0
        assert len(httpx.get(f"http://127.0.0.1:{port}/_bench/latencies").json()["seconds"]) >= 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert pstats.Stats(str(out)).total_calls > 0
