"""The options `bench serve` and `bench sweep` share reach the benchmark's config under their own names
and vLLM's aliases; `bench sweep --plot-path` and `bench plot --title` shape the PNG. The runs are
stand-ins (the config is caught before any request); the datasets' use of these fields is
tests/bench/test_datasets.py's."""
from __future__ import annotations

from pathlib import Path

import pytest
from matplotlib.figure import Figure
from typer.testing import CliRunner

from atom_core.bench import serve_bench, sweep
from atomctl.main import app
from tests.bench.test_sweep import _assert_png, _write_fake_set

DATASET_FLAGS = ["--sharegpt-output-len", "9", "--custom-output-len", "7", "--prefix-repetition-output-len", "11"]


class _Caught(Exception):
    pass


@pytest.fixture
def caught(monkeypatch) -> list:
    """The ServeBenchConfig each command built: the runs stop there."""
    configs = []

    def catch(cfg, *args, **kwargs):
        configs.append(cfg)
        raise _Caught("config caught")

    monkeypatch.setattr(serve_bench, "run_benchmark", catch)
    monkeypatch.setattr(sweep, "run_sweep", catch)
    return configs


COMMANDS = {"serve": ["bench", "serve"], "sweep": ["bench", "sweep", "--max-concurrency-list", "1,2"]}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_dataset_output_lengths_reach_the_config(caught, command):
    result = CliRunner().invoke(app, [*COMMANDS[command], *DATASET_FLAGS])
    assert result.exit_code == 1 and "config caught" in result.output, result.output
    (cfg,) = caught
    d = cfg.dataset
    assert (d.sharegpt_output_len, d.custom_output_len, d.prefix_repetition_output_len) == (9, 7, 11)
    assert d.apply_chat_template is False


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("flag", ["--apply-chat-template", "--use-chat-template"])  # ours, vLLM's
def test_chat_template_flag_and_its_vllm_alias(caught, command, flag):
    result = CliRunner().invoke(app, [*COMMANDS[command], flag])
    assert result.exit_code == 1 and "config caught" in result.output, result.output
    assert caught[0].dataset.apply_chat_template is True


def test_defaults_of_the_output_lengths(caught):
    CliRunner().invoke(app, COMMANDS["serve"])
    d = caught[0].dataset
    assert (d.sharegpt_output_len, d.custom_output_len, d.prefix_repetition_output_len) == (None, 256, 128)


def test_sweep_plot_path_is_where_the_png_goes(monkeypatch, tmp_path):
    results = _write_fake_set(tmp_path / "runs", 1.0)
    monkeypatch.setattr(sweep, "run_sweep", lambda *a, **k: sorted(results.glob("vllm-*.json")))
    png = tmp_path / "elsewhere" / "ours.png"
    result = CliRunner().invoke(app, ["bench", "sweep", "--max-concurrency-list", "1,4,16",
                                      "--result-dir", str(tmp_path / "out"), "--plot-path", str(png)])
    assert result.exit_code == 0, result.output
    _assert_png(png)
    assert "".join(result.output.split()) == f"plot:{png}"  # rich may wrap a long path
    assert not (tmp_path / "out" / "sweep.png").exists()


@pytest.mark.parametrize("args, title", [
    (["--title", "H200: ours vs vLLM"], "H200: ours vs vLLM"),
    ([], "Output throughput vs latency - other"),  # the default names the one model
])
def test_plot_title(monkeypatch, tmp_path, args, title):
    titles = []
    save = Figure.savefig

    def recording(fig, *a, **k):
        titles.append(fig._suptitle.get_text())
        return save(fig, *a, **k)

    monkeypatch.setattr(Figure, "savefig", recording)
    png = tmp_path / "cmp.png"
    result = CliRunner().invoke(app, ["bench", "plot", str(_write_fake_set(tmp_path / "a", 1.0)), "-o", str(png), *args])
    assert result.exit_code == 0, result.output
    assert titles == [title]
    _assert_png(Path(png))
