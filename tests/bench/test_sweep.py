"""Sweeps over concurrency / rate against the fake server, result sets, and the PNG."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from atom_core.bench.datasets import DatasetConfig
from atom_core.bench.serve_bench import ServeBenchConfig
from atom_core.bench.sweep import load_result_set, parse_number_list, plot_result_sets, run_sweep
from atomctl.bench import bench_app

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _cfg(server, **kwargs) -> ServeBenchConfig:
    dataset = DatasetConfig(random_input_len=12, random_output_len=4)
    return ServeBenchConfig(base_url=server.base_url, model="fake-model", dataset=dataset, num_prompts=6,
                            show_progress=False, **kwargs)


def _write_fake_set(directory: Path, scale: float) -> Path:
    """A result set as another server would have left it (only the keys the plot reads, plus one stray JSON)."""
    directory.mkdir(parents=True)
    for c in (1, 4, 16):
        result = {"backend": "vllm", "model_id": "other", "max_concurrency": c, "request_rate": "inf",
                  "output_throughput": scale * 100 * c ** 0.8, "median_tpot_ms": 10 + c, "median_ttft_ms": 20 + 3 * c}
        (directory / f"vllm-infqps-concurrency{c}.json").write_text(json.dumps(result))
    (directory / "notes.json").write_text(json.dumps({"comment": "not a result"}))
    return directory


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 10_000


class TestRunSweep:
    def test_concurrency_sweep_writes_one_result_per_point(self, fake_server, tmp_path, byte_bpe):
        # The plot needs median TTFT/TPOT, so a sweep adds them even when not selected.
        cfg = _cfg(fake_server, percentile_metrics="e2el")
        paths = run_sweep(cfg, tmp_path / "ours", max_concurrency_list=[4, 1, 2], tokenizer=byte_bpe,
                          console=Console(file=io.StringIO()))
        results = [json.loads(p.read_text()) for p in paths]
        assert [r["max_concurrency"] for r in results] == [4, 1, 2]
        assert all(r["completed"] == 6 and "median_tpot_ms" in r and "mean_e2el_ms" in r for r in results)
        assert len({p.name for p in paths}) == 3
        result_set = load_result_set(tmp_path / "ours")
        assert result_set.label == "ours"
        assert [r["max_concurrency"] for r in result_set.results] == [1, 2, 4]
        # Same prompts at every point.
        assert len({tuple(r["input_lens"]) for r in results}) == 1
        _assert_png(plot_result_sets([result_set, load_result_set(_write_fake_set(tmp_path / "other", 2.0))],
                                     tmp_path / "plot.png"))

    def test_rate_sweep(self, fake_server, tmp_path, byte_bpe):
        paths = run_sweep(_cfg(fake_server), tmp_path, request_rate_list=[200.0, float("inf")],
                          tokenizer=byte_bpe, console=Console(file=io.StringIO()))
        assert [json.loads(p.read_text())["request_rate"] for p in paths] == [200.0, "inf"]
        _assert_png(plot_result_sets([load_result_set(tmp_path)], tmp_path / "rates.png"))

    def test_needs_exactly_one_list(self, fake_server, tmp_path):
        with pytest.raises(ValueError, match="exactly one of"):
            run_sweep(_cfg(fake_server), tmp_path)


class TestResultSets:
    def test_single_file_and_errors(self, tmp_path):
        directory = _write_fake_set(tmp_path / "set", 1.0)
        one = load_result_set(directory / "vllm-infqps-concurrency4.json", label="four")
        assert one.label == "four" and len(one.results) == 1
        with pytest.raises(ValueError, match="does not exist"):
            load_result_set(tmp_path / "missing")
        with pytest.raises(ValueError, match="no benchmark result JSON files"):
            load_result_set(tmp_path)
        with pytest.raises(ValueError, match="is not a benchmark result"):
            load_result_set(directory / "notes.json")
        partial = tmp_path / "partial.json"
        partial.write_text(json.dumps({"output_throughput": 1.0, "median_ttft_ms": 1.0}))
        with pytest.raises(ValueError, match="lacks median_tpot_ms"):
            load_result_set(partial)

    def test_parse_number_list(self):
        assert parse_number_list("1, 4,16", "--max-concurrency-list", True) == [1, 4, 16]
        assert parse_number_list("0.5,inf", "--request-rate-list", False) == [0.5, float("inf")]
        for bad, match in [("1,x", "bad value 'x' in --max-concurrency-list"), ("0", "must be > 0"), (",", "is empty")]:
            with pytest.raises(ValueError, match=match):
                parse_number_list(bad, "--max-concurrency-list", True)


# --- CLI --------------------------------------------------------------------------------


def _cli() -> typer.Typer:
    app = typer.Typer()
    app.add_typer(bench_app, name="bench")
    return app


def _one_line_error(result, message: str) -> None:
    assert result.exit_code != 0
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output


class TestSweepCli:
    def test_sweep_compares_with_an_earlier_set(self, fake_server, tmp_path, byte_bpe_dir):
        other = _write_fake_set(tmp_path / "baseline", 1.5)
        out = tmp_path / "ours"
        args = ["bench", "sweep", "--base-url", fake_server.base_url, "--model", "fake-model",
                "--tokenizer", str(byte_bpe_dir), "--random-input-len", "10", "--random-output-len", "3",
                "--num-prompts", "4", "--max-concurrency-list", "1,2", "--result-dir", str(out),
                "--label", "ours", "--compare", str(other), "--disable-tqdm"]
        result = CliRunner().invoke(_cli(), args)
        assert result.exit_code == 0, result.output
        assert len(list(out.glob("*.json"))) == 2
        _assert_png(out / "sweep.png")

    def test_plot_only(self, tmp_path):
        a, b = _write_fake_set(tmp_path / "a", 1.0), _write_fake_set(tmp_path / "b", 2.0)
        png = tmp_path / "cmp.png"
        result = CliRunner().invoke(_cli(), ["bench", "plot", str(a), str(b), "-o", str(png),
                                             "--label", "server A", "--label", "server B"])
        assert result.exit_code == 0, result.output
        _assert_png(png)

    @pytest.mark.parametrize(
        "args, message",
        [
            ([], "give exactly one of --max-concurrency-list and --request-rate-list"),
            (["--max-concurrency-list", "1", "--request-rate-list", "2"], "give exactly one of"),
            (["--max-concurrency-list", "1,four"], "bad value 'four' in --max-concurrency-list"),
            (["--request-rate-list", "1,-2"], "--request-rate-list values must be > 0"),
            (["--max-concurrency-list", "1", "--compare", "/no/such/dir"], "result path '/no/such/dir' does not exist"),
            (["--max-concurrency-list", "1", "--goodput", "ttft"], "bad --goodput item 'ttft'"),
        ],
    )
    def test_sweep_bad_flags(self, args, message):
        base = ["bench", "sweep", "--model", "m", "--base-url", "http://127.0.0.1:9"]
        _one_line_error(CliRunner().invoke(_cli(), base + args), message)

    def test_plot_bad_input(self, tmp_path):
        _one_line_error(CliRunner().invoke(_cli(), ["bench", "plot", str(tmp_path / "nope")]), "does not exist")
        a = _write_fake_set(tmp_path / "a", 1.0)
        result = CliRunner().invoke(_cli(), ["bench", "plot", str(a), "--label", "x", "--label", "y"])
        _one_line_error(result, "got 2 --label values for 1 paths")
