"""What a new user meets first with the benchmarks: the served model's tokenizer is found without a
model hub, default lengths shrink to fit a short max_model_len (with a notice) while lengths that
were asked for and cannot fit are one error naming their flags, and the offline benchmarks show
progress and report a TPOT consistent with their TTFT and end-to-end times."""
from __future__ import annotations

import io
import json
import socket

import pytest
from rich.console import Console
from typer.testing import CliRunner

from atom_core.bench.datasets import DEFAULT_RANDOM_LENS, DatasetConfig, check_fit, fit_to_model, length_tolerance
from atom_core.bench.lengths import Length, fit_lengths
from atom_core.bench.offline import fit_latency_lengths, fit_workload
from atom_core.bench.serve_bench import ServeBenchConfig, load_tokenizer, prepare_run, sample_fitting_requests
from atom_core.loader.model_dir import DEMO_MODEL_DIR
from atomctl.main import app

runner = CliRunner()


_LOOPBACK = ("127.0.0.1", "::1", "localhost")


@pytest.fixture
def no_network(monkeypatch):
    """Every connection or name lookup off this machine fails and is recorded: a model hub asked
    shows up here (the benchmark's own server on 127.0.0.1 is let through)."""
    attempts = []
    connect, getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def guarded_connect(self, address, *args, **kwargs):
        if isinstance(address, tuple) and address[0] not in _LOOPBACK:
            attempts.append(address)
            raise OSError(f"test: no network ({address})")
        return connect(self, address, *args, **kwargs)

    def guarded_getaddrinfo(host, *args, **kwargs):
        if host not in _LOOPBACK:
            attempts.append(host)
            raise socket.gaierror(f"test: no name lookups ({host})")
        return getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", guarded_connect)
    monkeypatch.setattr(socket, "getaddrinfo", guarded_getaddrinfo)
    return attempts


class TestFitLengths:
    def test_defaults_that_fit_are_kept_without_a_notice(self):
        fitted = fit_lengths([Length("--a", None, 100), Length("--b", None, 50)], 512, "max_model_len 512")
        assert fitted.values == (100, 50) and fitted.notice is None

    def test_defaults_shrink_in_proportion_and_the_notice_names_their_flags(self):
        fitted = fit_lengths([Length("--a", None, 1024), Length("--b", None, 1024)], 512, "max_model_len 512")
        assert fitted.values == (256, 256)
        assert "max_model_len 512" in fitted.notice and "--a 256 (default 1024)" in fitted.notice
        assert "--b" in fitted.notice

    def test_a_given_length_is_kept_and_the_defaults_take_the_rest(self):
        fitted = fit_lengths([Length("--a", 400, 1024), Length("--b", None, 1024)], 512, "max_model_len 512")
        assert fitted.values == (400, 112) and "--b 112" in fitted.notice and "--a" not in fitted.notice.split(";")[1]

    @pytest.mark.parametrize("a,b", [(600, None), (300, 300)])
    def test_given_lengths_that_do_not_fit_are_an_error_naming_the_flags(self, a, b):
        with pytest.raises(ValueError, match=r"tokens do not fit max_model_len 512; lower --a, --b, or raise the model's --max-model-len"):
            fit_lengths([Length("--a", a, 1024), Length("--b", b, 1024)], 512, "max_model_len 512")


class TestOfflineDefaults:
    def test_the_default_workload_fits_the_demo_model(self):
        workload, notice = fit_workload(512)
        prompts, params = workload.build()
        assert max(len(p) + sp.max_tokens for p, sp in zip(prompts, params)) <= 512
        assert (workload.max_input_len, workload.max_output_len) == (256, 256)
        assert "--max-input-len" in notice and "--max-output-len" in notice

    def test_a_long_model_keeps_nano_vllms_workload(self):
        workload, notice = fit_workload(4096)
        assert notice is None and workload == fit_workload(1 << 30)[0]
        assert (workload.min_input_len, workload.max_input_len, workload.max_output_len) == (100, 1024, 1024)

    def test_minima_follow_shrunk_maxima(self):
        workload, _ = fit_workload(64)
        assert (workload.min_input_len, workload.max_input_len) == (32, 32)

    def test_an_explicit_workload_that_cannot_fit_names_the_flags(self):
        with pytest.raises(ValueError, match="--max-input-len 1024 = 1024 tokens do not fit max_model_len 512"):
            fit_workload(512, max_input_len=1024)

    def test_latency_lengths(self):
        assert fit_latency_lengths(512, None, None) == (128, 256, None)
        assert fit_latency_lengths(512, 300, None)[:2] == (300, 212)
        with pytest.raises(ValueError, match="--input-len 400 \\+ --output-len 200 = 600 tokens"):
            fit_latency_lengths(512, 400, 200)


class TestServeDatasetFit:
    def test_random_defaults_fit_with_the_length_tolerance(self):
        fitted, notice = fit_to_model(DatasetConfig(), 512)
        assert fitted.input_len + fitted.output_len <= 512 - length_tolerance(512)
        assert "--random-input-len" in notice and "the server's max_model_len 512" in notice
        long, notice = fit_to_model(DatasetConfig(), 4096)
        assert notice is None and (long.input_len, long.output_len) == DEFAULT_RANDOM_LENS
        assert (DatasetConfig().input_len, DatasetConfig().output_len) == DEFAULT_RANDOM_LENS

    def test_the_range_ratio_is_allowed_for(self):
        fitted, _ = fit_to_model(DatasetConfig(random_range_ratio=0.5), 512)
        assert (fitted.input_len + fitted.output_len) * 1.5 <= 512

    def test_explicit_random_lengths_that_cannot_fit_name_the_flags(self):
        with pytest.raises(ValueError, match="--random-input-len 600 = 600 tokens do not fit"):
            fit_to_model(DatasetConfig(random_input_len=600), 512)

    def test_requests_of_other_datasets_are_checked_with_their_flags(self, byte_bpe):
        from atom_core.bench.datasets import sample_requests

        cfg = DatasetConfig(name="prefix-repetition", prefix_repetition_num_prefixes=1)
        requests = sample_requests(cfg, byte_bpe, 2, seed=0)
        check_fit(cfg, requests, 1024)
        with pytest.raises(ValueError, match=r"2 of 2 requests do not fit the server's max_model_len 300 .*"
                                             r"--prefix-repetition-prefix-len"):
            check_fit(cfg, requests, 300)


class TestTokenizerWithoutAHub:
    def test_demo_and_presets_and_directories_load_locally(self, no_network, byte_bpe_dir):
        demo = load_tokenizer("demo")
        assert demo.encode("12 + 7 =") == load_tokenizer(str(DEMO_MODEL_DIR)).encode("12 + 7 =")
        assert load_tokenizer("preset:Llama-3-8B").decode([128000]) == "t128000"
        assert load_tokenizer(str(byte_bpe_dir)).vocab_size > 0
        assert no_network == []

    def test_a_hub_id_not_in_the_cache_fails_in_one_line_without_connecting(self, no_network):
        with pytest.raises(ValueError) as err:
            load_tokenizer("no-such-org/no-such-model")
        assert no_network == []
        message = str(err.value)
        assert "\n" not in message and "no-such-org/no-such-model" in message and "--tokenizer" in message

    def test_a_hub_id_in_the_cache_loads_from_it_without_connecting(self, no_network, byte_bpe_dir, tmp_path,
                                                                      monkeypatch):
        import shutil

        from huggingface_hub import constants

        snapshot = tmp_path / "models--some-org--some-model" / "snapshots" / "0123abcd"
        shutil.copytree(byte_bpe_dir, snapshot)
        (tmp_path / "models--some-org--some-model" / "refs").mkdir()
        (tmp_path / "models--some-org--some-model" / "refs" / "main").write_text("0123abcd")
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
        assert load_tokenizer("some-org/some-model").encode("hello world") == load_tokenizer(
            str(byte_bpe_dir)).encode("hello world")
        assert no_network == []

    def test_the_servers_root_names_the_tokenizer(self, fake_server, byte_bpe_dir, no_network):
        fake_server.configure(model_entry={"id": "served-name", "root": str(byte_bpe_dir), "max_model_len": 2048})
        run = prepare_run(ServeBenchConfig(base_url=fake_server.base_url))
        assert no_network == []
        assert (run.model_id, run.tokenizer_id, run.max_model_len) == ("served-name", str(byte_bpe_dir), 2048)

    def test_the_served_name_demo_is_the_built_in_model(self, fake_server, no_network):
        fake_server.configure(model_entry={"id": "demo", "root": "/not/on/this/machine", "max_model_len": 512})
        cfg = ServeBenchConfig(base_url=fake_server.base_url, num_prompts=2)
        run = prepare_run(cfg)
        assert run.tokenizer_id == "demo" and run.tokenizer.encode("1 + 1 =") == load_tokenizer("demo").encode("1 + 1 =")
        console = Console(file=io.StringIO(), width=300)
        requests = sample_fitting_requests(run, cfg, console)
        assert all(r.prompt_len + r.expected_output_len <= 512 for r in requests) and no_network == []
        assert "the default lengths do not fit the server's max_model_len 512" in console.file.getvalue()

    def test_no_tokenizer_is_one_line_naming_what_was_tried(self, fake_server):
        fake_server.configure(model_entry={"id": "org/unknown", "root": "/not/here"})
        res = runner.invoke(app, ["bench", "serve", "--base-url", fake_server.base_url, "--num-prompts", "1"])
        assert res.exit_code == 1, res.output
        line = res.output.strip()
        assert len(line.splitlines()) == 1 and line.startswith("error: cannot find the tokenizer of model 'org/unknown'")
        assert "'/not/here' or 'org/unknown'" in line and "--tokenizer" in line

    def test_explicit_lengths_the_server_cannot_hold_fail_before_any_request(self, fake_server):
        fake_server.configure(model_entry={"id": "demo", "max_model_len": 512})
        res = runner.invoke(app, ["bench", "serve", "--base-url", fake_server.base_url, "--num-prompts", "1",
                                  "--random-input-len", "600"])
        assert res.exit_code == 1 and "--random-input-len 600 = 600 tokens do not fit" in res.output
        assert fake_server.stats()["payloads"] == []


class TestOfflineCommands:
    def test_offline_fits_its_defaults_and_shows_progress(self, tiny_llama, tmp_path):
        out = tmp_path / "off.json"
        res = runner.invoke(app, ["bench", "offline", "--model", str(tiny_llama), "--device", "cpu",
                                  "--max-model-len", "48", "--num-prompts", "2", "--output-json", str(out)])
        assert res.exit_code == 0, res.output
        assert "the default lengths do not fit max_model_len 48" in " ".join(res.output.split())
        assert "output tokens" in res.output
        data = json.loads(out.read_text())
        assert data["workload"]["max_input_len"] + data["workload"]["max_output_len"] <= 48
        assert f"{data['output_tokens']}/{data['output_tokens']}" in res.output  # the bar ran to the end

    def test_offline_explicit_lengths_that_cannot_fit_name_the_flags(self, tiny_llama):
        res = runner.invoke(app, ["bench", "offline", "--model", str(tiny_llama), "--device", "cpu",
                                  "--max-model-len", "48", "--max-input-len", "40", "--max-output-len", "40"])
        assert res.exit_code == 1
        assert "--max-input-len 40 + --max-output-len 40 = 80 tokens do not fit max_model_len 48" in res.output

    def test_latency_tpot_is_consistent_with_ttft_and_e2e_of_the_same_runs(self, tiny_llama, tmp_path):
        out = tmp_path / "lat.json"
        res = runner.invoke(app, ["bench", "latency", "--model", str(tiny_llama), "--device", "cpu", "--bs", "2",
                                  "--input-len", "8", "--output-len", "6", "--num-iters", "3",
                                  "--num-iters-warmup", "1", "--output-json", str(out)])
        assert res.exit_code == 0, res.output
        assert "output tokens" in res.output and "48/48" in res.output  # (1 + 3) runs x 2 requests x 6 tokens
        data = json.loads(out.read_text())
        assert len(data["runs"]) == 3
        for run in data["runs"]:
            assert 0 < run["ttft_s"] < run["e2e_s"]
            assert run["tpot_s"] == pytest.approx((run["e2e_s"] - run["ttft_s"]) / 5) and run["tpot_s"] > 0
        assert data["tpot_s"] == pytest.approx(sorted(r["tpot_s"] for r in data["runs"])[1])
        assert sorted(r["ttft_s"] for r in data["runs"])[1] == pytest.approx(data["ttft_s"]["median"])
        assert sorted(r["e2e_s"] for r in data["runs"])[1] == pytest.approx(data["e2e_s"]["median"])

    def test_latency_explicit_lengths_that_cannot_fit_name_the_flags(self, tiny_llama):
        res = runner.invoke(app, ["bench", "latency", "--model", str(tiny_llama), "--device", "cpu",
                                  "--max-model-len", "32", "--input-len", "30", "--output-len", "8"])
        assert res.exit_code == 1
        assert "--input-len 30 + --output-len 8 = 38 tokens do not fit max_model_len 32" in res.output
