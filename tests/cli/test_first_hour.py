"""First-hour rough edges of the CLI: `--log-level` refuses what it does not know, naming the
choices; the tables of `atomctl eval` and `atomctl parse-trace` keep their numbers and module names
whole in an 80-column terminal; the profiler prints no kineto USDT lines."""
from __future__ import annotations

import os

import pandas as pd
import pytest
from rich.console import Console
from typer.testing import CliRunner

from atomctl.main import app

runner = CliRunner()


class TestLogLevel:
    def test_an_unknown_level_is_refused_with_the_choices(self):
        res = runner.invoke(app, ["--log-level", "BOGUS", "generate", "x"])
        assert res.exit_code == 2
        assert "unknown log level 'BOGUS'; expected one of: DEBUG, INFO, WARNING, ERROR, CRITICAL" in res.output

    @pytest.mark.parametrize("level", ["info", "ERROR", "Debug"])
    def test_known_levels_in_any_case(self, level):
        res = runner.invoke(app, ["--log-level", level, "generate", "--help"])
        assert res.exit_code == 0, res.output


def _render(table, width: int = 80) -> list[str]:
    console = Console(width=width, record=True, file=open(os.devnull, "w"))
    console.print(table)
    return console.export_text().splitlines()


class TestEvalTable:
    def test_scores_are_whole_at_80_columns(self):
        from atom_core.eval.runner import ScoreRow
        from atomctl.eval_cmd import results_table

        rows = [ScoreRow("atom_arith_gen_chat", "exact_match", "flexible-extract", 0.9875, 0.0123, 0, 200),
                ScoreRow("atom_arith_mc", "acc_norm", "none", 1.0, None, 5, 1000)]
        lines = _render(results_table(rows, "lm-eval: server"))
        assert max(len(line) for line in lines) <= 80
        text = "\n".join(lines)
        for cell in ("0.9875", "0.0123", "1.0000", "n/a", "1000", "atom_arith_mc"):
            assert cell in text
        assert "…" not in text


class TestParseTraceTable:
    MODULES = ["layers.3.self_attn.qkv_proj", "layers.3.post_attention_layernorm", "layers.3.mlp.gate_up_proj"]

    def _frame(self) -> pd.DataFrame:
        kernel = "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(Params)"
        return pd.DataFrame({"cpu_module": self.MODULES, "gpu_kernel": [kernel, "triton_rms_norm", "nvjet_tst_128x256"],
                             "duration_us": [1234567.5, 12.25, 88.0], "sum per module": [1234567.5, float("nan"), 88.0]})

    def test_module_names_and_numbers_stay_whole_at_80_columns(self):
        from atom_core.profiling.report import _rich_table

        lines = _render(_rich_table("prefill: layer 3", self._frame(), 80))
        assert max(len(line) for line in lines) <= 80
        cells = [cell.strip() for line in lines for cell in line.split("│")]
        for name in (*self.MODULES, "1,234,567.5", "12.2", "88.0"):
            assert name in cells, name  # whole, in one cell of one line

    def test_parse_trace_prints_tables_that_fit(self, monkeypatch, tmp_path):
        """The whole command at COLUMNS=80 on a checked-in trace."""
        from tests.profiling.fixtures import DATA_DIR

        monkeypatch.setenv("COLUMNS", "80")
        res = runner.invoke(app, ["parse-trace", str(DATA_DIR / "fixture_trace.json.gz"), "--out-dir", str(tmp_path)])
        assert res.exit_code == 0, res.output
        table_lines = [line for line in res.output.splitlines() if line[:1] in "┏┃┡│└"]
        assert table_lines and max(len(line) for line in table_lines) <= 80
        assert "layers.3.self_attn.qkv_proj" in res.output


class TestProfilerOutput:
    def test_no_usdt_lines_and_other_output_passes(self, tmp_path, capfd):
        import sys

        from atom_core.config import ProfilerConfig
        from atom_core.profiling.profiler import TorchProfiler, without_usdt_lines

        profiler = TorchProfiler(ProfilerConfig(torch_profiler_dir=str(tmp_path)), "m")
        profiler.start()
        profiler.stop()
        with without_usdt_lines():
            os.write(2, b"USDT:2026 fake probe line\nkineto: a real warning\n")
            print("python stderr", file=sys.stderr)
        err = capfd.readouterr().err
        assert "USDT" not in err
        assert "kineto: a real warning\n" in err and "python stderr\n" in err
