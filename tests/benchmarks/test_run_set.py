"""benchmarks/run_set.py: every set's commands resolve (dry run), and the runner's steps, limits and errors."""
from __future__ import annotations

import os
import time

import pytest

from benchmarks import run_set
from benchmarks.run_set import check, expand, main, run_step
from benchmarks.sets import SETS, BenchSet, Step


@pytest.mark.parametrize("name", sorted(SETS))
def test_every_command_of_the_set_resolves(name):
    bench_set = SETS[name]
    assert bench_set.steps and bench_set.description
    assert len({s.name for s in bench_set.steps}) == len(bench_set.steps), "step names name the logs: keep them apart"
    assert main([name, "--dry-run"]) == 0


class TestCheck:
    @pytest.mark.parametrize("command, message", [
        ("atomctl bench nope", "atomctl has no command 'bench nope'"),
        ("atomctl bench latency --model m --bogus 1", "No such option: --bogus"),
        ("atomctl bench latency --model m --bs x", "--bs"),
        ("python -m benchmarks.kernels.nope", "no module benchmarks.kernels.nope"),
        ("python benchmarks/kernels/fp8_bench.py", "expected `python -m MODULE ...`"),
        ("bash run.sh", "unknown executable 'bash'"),
    ])
    def test_a_command_that_would_not_start_is_an_error(self, command, message):
        with pytest.raises(ValueError, match=message):
            check(Step("s", command, 10))

    def test_a_step_needs_a_positive_time_limit(self):
        with pytest.raises(ValueError, match="timeout_s must be positive"):
            check(Step("s", "python -m benchmarks.run_set --list", 0))


def test_expand_runs_atomctl_and_python_with_this_interpreter(tmp_path):
    import sys

    assert expand("atomctl bench latency --output-json {out}/a.json", tmp_path) == [
        sys.executable, "-m", "atomctl.main", "bench", "latency", "--output-json", f"{tmp_path}/a.json"]
    old, new = tmp_path / "old.json.gz", tmp_path / "new.json.gz"
    old.write_text(""), new.write_text("")
    os.utime(old, (time.time() - 60, time.time() - 60))
    assert expand("python -m m {newest:" + str(tmp_path) + "/*.json.gz}", tmp_path)[-1] == str(new)


class TestRunStep:
    def test_output_goes_to_the_log_and_the_exit_code_is_kept(self, tmp_path):
        outcome = run_step(Step("fails", "python -c \"print('hello'); raise SystemExit(3)\"", 60), tmp_path, float("inf"))
        assert outcome.status == "3" and (tmp_path / "fails.log").read_text() == "hello\n"

    def test_a_step_past_its_limit_is_stopped(self, tmp_path):
        start = time.monotonic()
        outcome = run_step(Step("hangs", "python -c \"import time; time.sleep(60)\"", 1), tmp_path, float("inf"))
        assert outcome.status == "timeout" and time.monotonic() - start < 30

    def test_a_step_that_would_pass_the_deadline_is_skipped(self, tmp_path):
        outcome = run_step(Step("late", "python -c pass", 100), tmp_path, time.monotonic() + 10)
        assert outcome.status == "skipped" and not (tmp_path / "late.log").exists()

    def test_a_missing_trace_is_reported_not_run(self, tmp_path):
        outcome = run_step(Step("parse", "python -m m {newest:" + str(tmp_path) + "/*.gz}", 10), tmp_path, float("inf"))
        assert outcome.status == "missing input" and "no file matches" in (tmp_path / "parse.log").read_text()


def test_main_exits_nonzero_when_a_step_fails(tmp_path, monkeypatch, capsys):
    steps = (Step("ok", "python -c pass", 60), Step("bad", "python -c \"raise SystemExit(1)\"", 60))
    monkeypatch.setitem(SETS, "two", BenchSet("two steps", steps))
    assert main(["two", "--out-dir", str(tmp_path)]) == 1
    table = capsys.readouterr().out.splitlines()[-2:]
    assert table[0].split()[:2] == ["ok", "0"] and table[1].split()[:2] == ["bad", "1"]


@pytest.mark.parametrize("argv, message", [
    (["nope"], "unknown set nope; expected one of: "),
    ([], "name a set"),
    (["dense", "--deadline-s", "0"], "--deadline-s must be positive"),
])
def test_bad_arguments_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        run_set.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_server_command_needs_a_port():
    with pytest.raises(ValueError, match="needs --port"):
        run_set._port("atomctl serve --model m")
