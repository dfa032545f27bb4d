"""parse-trace: attribution, CUDA-graph mapping, tables, workbooks, CLI and errors.

Most tests run on the synthetic GPU trace built by fixtures.py (its doc describes it).
"""
from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import typer
from typer.testing import CliRunner

from atom_core.profiling.breakdown import BREAKDOWN_COLUMNS, STEPS_COLUMNS, SUMMARY_COLUMNS, _average_layers, parse_trace
from atom_core.profiling.conventions import normalize_layer, parse_step_name, step_range_name
from atom_core.profiling.module_types import module_type
from atom_core.profiling.report import write_plots, write_workbooks
from atom_core.profiling.trace_events import TraceEvent, innermost_enclosing, self_times, trace_events_from_json
from atom_core.profiling.trace_parser import (
    GRAPH_HINT,
    GRAPH_MODULE,
    NO_MODULE,
    attribute_kernels,
    find_capture_traces,
    graph_captures,
)
from atomctl.profile import register
from tests.profiling import fixtures as fx


SHEETS = ["layer_3", "all_layers_avg", "full_step", "summary", "steps"]


@pytest.fixture
def lone_trace(tmp_path) -> Path:
    """The fixture trace alone in a directory: no capture trace beside it."""
    return Path(shutil.copy(fx.FIXTURE_TRACE, tmp_path / "trace.json.gz"))


@pytest.fixture(scope="module")
def breakdown():
    """The checked-in trace, with the checked-in bs=2 capture found beside it."""
    return parse_trace(fx.FIXTURE_TRACE)


def _events(data: dict):
    return trace_events_from_json(data)


def _write(tmp_path: Path, data: dict, name: str = "t.json") -> Path:
    return fx.write_trace(data, tmp_path / name)


def _drop(data: dict, predicate) -> dict:
    return {**data, "traceEvents": [e for e in data["traceEvents"] if not predicate(e)]}


def _expected_step_kernels(num_layers: int = fx.NUM_LAYERS) -> list[tuple[str, str]]:
    return fx.model_kernels(num_layers) + [(NO_MODULE, fx.SAMPLER_KERNEL)]


class TestFixtureFiles:
    def test_checked_in_files_equal_what_the_helper_builds(self):
        for path, data in ((fx.FIXTURE_TRACE, fx.build_trace()), (fx.FIXTURE_CAPTURE, fx.build_capture_trace(2))):
            with gzip.open(path, "rt") as f:
                assert json.load(f) == data, f"{path} is stale; regenerate: python tests/profiling/fixtures.py"


class TestAttribution:
    def test_kernels_are_attributed_through_correlation_ids(self):
        attribution = attribute_kernels(_events(fx.build_trace()))
        prefill = [k for k in attribution.kernels if k.step == 0]
        assert [(k.module, k.kernel) for k in prefill] == _expected_step_kernels()
        for k in prefill:
            module = "" if k.module == NO_MODULE else k.module
            assert k.dur == fx.kernel_duration("prefill", module, k.kernel)

    def test_kernels_launched_outside_steps_are_ignored(self):
        attribution = attribute_kernels(_events(fx.build_trace()))
        assert "warmup_kernel" not in {k.kernel for k in attribution.kernels}
        assert [s.phase for s in attribution.steps] == ["prefill", "decode", "decode", "decode"]

    def test_graph_replay_kernels_take_the_modules_of_the_capture(self):
        captures = graph_captures(_events(fx.build_capture_trace(2)), "capture")
        attribution = attribute_kernels(_events(fx.build_trace()), captures)
        for step in (2, 3):
            replay = [(k.module, k.kernel) for k in attribution.kernels if k.step == step]
            assert replay == _expected_step_kernels()
        assert attribution.notes == []

    def test_graph_replay_without_capture_is_reported_unattributed(self):
        attribution = attribute_kernels(_events(fx.build_trace()))
        replay = [k for k in attribution.kernels if k.step == 2]
        assert {k.module for k in replay[:-1]} == {GRAPH_MODULE}
        assert replay[-1].module == NO_MODULE  # the sampler, launched eagerly after the replay
        assert attribution.notes == [GRAPH_HINT]

    def test_capture_with_another_kernel_count_is_refused(self):
        captures = graph_captures(_events(fx.build_capture_trace(2, num_layers=3)), "capture")
        attribution = attribute_kernels(_events(fx.build_trace()), captures)
        assert {k.module for k in attribution.kernels if k.step == 2} == {GRAPH_MODULE, NO_MODULE}
        assert "matched no capture trace" in attribution.notes[0]

    def test_capture_counts_only_launches_made_while_capturing(self):
        (capture,) = graph_captures(_events(fx.build_capture_trace(4)), "capture")
        assert capture.batch_size == 4
        assert list(capture.modules) == [m for m, _ in fx.model_kernels()]


class TestGraphCaptureFiles:
    def test_capture_beside_the_trace_is_found(self, breakdown):
        assert breakdown.capture_sources == [str(fx.FIXTURE_CAPTURE)]
        assert breakdown.phases["decode"].num_steps_averaged == 3
        assert len(breakdown.phases["decode"].layer_table) == 10

    def test_without_capture_decode_layers_are_empty_and_the_hint_is_given(self, lone_trace):
        result = parse_trace(lone_trace)
        assert GRAPH_HINT in result.notes
        decode = result.phases["decode"]
        assert decode.num_steps_averaged == 2  # the two replays share one kernel sequence
        assert decode.layer_table.empty
        assert set(decode.sheets["full_step"]["cpu_module"]) == {GRAPH_MODULE, NO_MODULE}

    def test_without_layers_the_terminal_shows_the_step_kernels_by_name(self, lone_trace):
        from rich.console import Console

        from atom_core.profiling.report import kernels_by_name, print_breakdown

        decode = parse_trace(lone_trace).phases["decode"]
        full = decode.sheets["full_step"]
        by_name = kernels_by_name(full)
        assert by_name["duration_us"].sum() == pytest.approx(full["duration_us"].sum())  # nothing lost
        assert by_name["launches"].sum() == len(full) and by_name["duration_us"].is_monotonic_decreasing
        for name, group in full.groupby("gpu_kernel"):
            row = by_name[by_name["gpu_kernel"] == name].iloc[0]
            assert row["duration_us"] == pytest.approx(group["duration_us"].sum()) and row["launches"] == len(group)
        console = Console(record=True, width=200)
        print_breakdown(parse_trace(lone_trace), console=console, top=2)
        text = console.export_text()
        assert f"decode: whole step, top 2 of {len(by_name)} kernel names" in text
        assert by_name["gpu_kernel"][0][:40] in text  # the largest is printed

    def test_explicit_capture_trace_is_used(self, lone_trace):
        result = parse_trace(lone_trace, capture_paths=[fx.FIXTURE_CAPTURE])
        assert result.notes == []
        assert len(result.phases["decode"].layer_table) == 10

    def test_only_captures_of_the_traced_model_are_found(self, tmp_path):
        trace = tmp_path / "Qwen3-8B_20260101_120000_000.pt.trace.json.gz"
        names = [trace.name, "capture_bs4_Qwen3-8B_20260101_115959_000.pt.trace.json.gz",
                 "capture_bs4_Llama-3-8B_20260101_115959_000.pt.trace.json.gz", "notes.txt"]
        for name in names:
            (tmp_path / name).write_text("{}")
        assert [p.name for p in find_capture_traces(trace)] == [names[1]]
        assert len(find_capture_traces(tmp_path / "renamed.json.gz")) == 2  # unknown model: every capture

    def test_a_trace_without_capture_range_is_not_a_capture_trace(self, lone_trace):
        with pytest.raises(ValueError, match="not a capture trace"):
            parse_trace(lone_trace, capture_paths=[lone_trace])


class TestTables:
    def test_layer_filter(self):
        result = parse_trace(fx.FIXTURE_TRACE, layer=1)
        table = result.phases["prefill"].sheets["layer_1"]
        assert list(table["cpu_module"].str.split(".").str[1].unique()) == ["1"]
        expected = [(m, k) for m, k in fx.model_kernels() if m.startswith("layers.1.")]
        assert list(zip(table["cpu_module"], table["gpu_kernel"])) == expected
        assert list(table["duration_us"]) == [fx.kernel_duration("prefill", m, k) for m, k in expected]

    def test_decode_rows_are_the_mean_of_the_averaged_steps(self, breakdown):
        table = breakdown.phases["decode"].layer_table
        expected = [fx.kernel_duration("decode", m, k) + 0.25 for m, k in fx.model_kernels() if m.startswith("layers.3.")]
        assert list(table["duration_us"]) == expected  # steps 0, 1, 2 add 0, 1/4, 2/4 us

    def test_module_sums_equal_the_sum_of_their_rows(self, breakdown):
        for phase in breakdown.phases.values():
            for name in ("layer_3", "all_layers_avg", "full_step"):
                table = phase.sheets[name]
                group = (table["cpu_module"] != table["cpu_module"].shift()).cumsum()
                sums = table.groupby(group)["duration_us"].sum()
                firsts = table.groupby(group)["sum per module"].first()
                assert list(firsts) == pytest.approx(list(sums))
                assert table["sum per module"].notna().sum() == group.nunique()

    def test_durations_are_positive(self, breakdown):
        for phase in breakdown.phases.values():
            for name in ("layer_3", "all_layers_avg", "full_step"):
                assert (phase.sheets[name]["duration_us"] > 0).all()

    def test_all_layers_sheet_averages_over_layers(self, breakdown):
        table = breakdown.phases["prefill"].all_layers_table
        assert table["cpu_module"].str.startswith("layers.*.").all()
        row = table[table["gpu_kernel"] == "nvjet_sm90_gemm_qkv"].iloc[0]
        assert row["duration_us"] == 4 * 10.0 + 0.5 * 1.5  # layer term averaged over layers 0..3
        assert len(table) == 10

    def test_all_layers_rows_add_up_to_the_mean_layer(self):
        rows = [("layers.0.norm", "rms_norm", 2.0), ("layers.0.norm", "add", 1.0), ("layers.1.norm", "fused_rms_norm", 3.0)]
        averaged = _average_layers(rows)
        assert averaged == [("layers.*.norm", "rms_norm", 1.0), ("layers.*.norm", "add", 0.5), ("layers.*.norm", "fused_rms_norm", 1.5)]
        assert sum(d for _, _, d in averaged) == sum(d for _, _, d in rows) / 2

    def test_summary_totals(self, breakdown):
        for phase in breakdown.phases.values():
            summary = phase.summary.set_index("module_type")
            full = phase.sheets["full_step"]
            assert summary.loc["total", "duration_us"] == pytest.approx(full["duration_us"].sum())
            assert summary.drop("total")["percent"].sum() == pytest.approx(100.0)
            assert summary.loc["GEMMs", "num_kernels"] == 4 * fx.NUM_LAYERS + 1
            assert summary.loc["norms", "num_kernels"] == 2 * fx.NUM_LAYERS + 1


class TestWorkbooks:
    def test_both_workbooks_have_the_documented_sheets_and_columns(self, breakdown, tmp_path):
        paths = write_workbooks(breakdown, tmp_path)
        assert sorted(p.name for p in paths) == ["decode_breakdown.xlsx", "prefill_breakdown.xlsx"]
        for path in paths:
            sheets = pd.read_excel(path, sheet_name=None)
            assert list(sheets) == SHEETS
            for name in ("layer_3", "all_layers_avg", "full_step"):
                assert list(sheets[name].columns) == BREAKDOWN_COLUMNS
            assert list(sheets["summary"].columns) == SUMMARY_COLUMNS
            assert list(sheets["steps"].columns) == STEPS_COLUMNS
            layer = sheets["layer_3"]
            assert len(layer) == 10 and layer["sum per module"].notna().sum() == 9

    def test_plots_are_written_per_phase(self, breakdown, tmp_path):
        paths = write_plots(breakdown, tmp_path)
        assert sorted(p.name for p in paths) == ["decode_breakdown.png", "prefill_breakdown.png"]
        assert all(p.stat().st_size > 1000 for p in paths)


class TestErrors:
    def test_missing_file(self, tmp_path):
        with pytest.raises(ValueError, match="not found"):
            parse_trace(tmp_path / "nope.json")

    @pytest.mark.parametrize("content", [b"hello", b"\x1f\x8bnot gzip", b'{"foo": 1}', b"[1, 2"])
    def test_not_a_trace(self, tmp_path, content):
        path = tmp_path / "bad.json"
        path.write_bytes(content)
        with pytest.raises(ValueError, match="not a Chrome trace"):
            parse_trace(path)

    def test_no_steps(self, tmp_path):
        data = _drop(fx.build_trace(), lambda e: e.get("name", "").startswith("atom_step"))
        with pytest.raises(ValueError, match="no engine steps"):
            parse_trace(_write(tmp_path, data))

    def test_no_kernels(self, tmp_path):
        data = _drop(fx.build_trace(), lambda e: e.get("cat") == "kernel")
        with pytest.raises(ValueError, match="no kernels"):
            parse_trace(_write(tmp_path, data))

    def test_no_decode_step(self, tmp_path):
        data = _drop(fx.build_trace(), lambda e: e.get("name", "").startswith("atom_step[decode]"))
        with pytest.raises(ValueError, match="no decode step"):
            parse_trace(_write(tmp_path, data))

    @pytest.mark.parametrize("layer", [4, 99, -1])
    def test_layer_out_of_range(self, layer):
        with pytest.raises(ValueError, match=rf"layer {layer} out of range; the trace has layers 0\.\.3"):
            parse_trace(fx.FIXTURE_TRACE, layer=layer)


class TestCli:
    @pytest.fixture
    def app(self):
        app = typer.Typer()
        register(app)
        app.callback()(lambda: None)  # keep subcommand names with two commands registered
        return app

    def test_parse_trace_writes_workbooks_and_plots(self, app, lone_trace, tmp_path):
        out = tmp_path / "out"
        args = ["parse-trace", str(lone_trace), "--out-dir", str(out), "--plot", "--capture-trace", str(fx.FIXTURE_CAPTURE)]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        assert "layer 3" in result.output and "wrote" in result.output
        assert sorted(p.name for p in out.iterdir()) == [
            "decode_breakdown.png", "decode_breakdown.xlsx", "prefill_breakdown.png", "prefill_breakdown.xlsx",
        ]

    def test_parse_trace_prints_the_graph_hint(self, app, lone_trace, tmp_path):
        result = CliRunner().invoke(app, ["parse-trace", str(lone_trace), "--out-dir", str(tmp_path)])
        assert result.exit_code == 0, result.output
        assert "could not be attributed to modules" in " ".join(result.output.split())

    def test_bad_input_is_one_line_and_exit_1(self, app, tmp_path):
        result = CliRunner().invoke(app, ["parse-trace", str(fx.FIXTURE_TRACE), "--layer", "7", "--out-dir", str(tmp_path)])
        assert result.exit_code == 1
        assert result.output.strip().splitlines() == ["error: layer 7 out of range; the trace has layers 0..3"]


def _ev(name: str, ts: float, dur: float, tid: int = 1) -> TraceEvent:
    return TraceEvent(name, "cpu_op", ts, dur, 1, tid)


class TestTimeline:
    def test_self_time_subtracts_direct_children(self):
        # aten::mm calls aten::resolve_conj: a leaf rule would keep the no-op and lose the matmul
        linear, t, mm, conj = _ev("aten::linear", 0, 100), _ev("aten::t", 1, 4), _ev("aten::mm", 6, 90), _ev("aten::resolve_conj", 7, 1)
        own = {e.name: d for e, d in self_times([conj, mm, t, linear])}
        assert own == {"aten::linear": 6, "aten::t": 4, "aten::mm": 89, "aten::resolve_conj": 1}
        assert sum(own.values()) == linear.dur

    def test_innermost_range_is_per_thread(self):
        outer, inner, other_thread = _ev("outer", 0, 50), _ev("inner", 10, 10), _ev("inner", 0, 100, tid=2)
        points = [_ev("p", 12, 1), _ev("p", 30, 1), _ev("p", 60, 1), _ev("p", 5, 1, tid=2)]
        found = innermost_enclosing([inner, outer, other_thread], points)
        assert found == [inner, outer, None, other_thread]


class TestConventions:
    def test_step_names_round_trip(self):
        name = step_range_name("decode", 5, 5, graph_bs=8)
        assert name == "atom_step[decode] bs=5 tokens=5 graph_bs=8"
        assert parse_step_name(name) == ("decode", {"bs": 5, "tokens": 5, "graph_bs": 8})
        assert parse_step_name("atom_step[prefill]") == ("prefill", {})
        assert parse_step_name("atom_step[mixed] bs=1") is None
        with pytest.raises(ValueError, match="unknown step phase"):
            step_range_name("mixed", 1, 1)

    def test_normalize_layer(self):
        assert normalize_layer("layers.13.mlp.down_proj") == "layers.*.mlp.down_proj"
        assert normalize_layer("model.layers.2.self_attn") == "model.layers.*.self_attn"
        assert normalize_layer("lm_head") == "lm_head"

    @pytest.mark.parametrize(
        "module, kernel, expected",
        [
            ("layers.0.self_attn.qkv_proj", "nvjet_sm90_gemm", "GEMMs"),
            ("layers.0.self_attn.attn", "flash_fwd_kernel", "attention"),
            ("layers.0.self_attn.rotary_emb", "elementwise_kernel", "attention"),
            ("layers.0.self_attn.q_norm", "rms_norm_kernel", "norms"),
            ("layers.0.mlp.act_fn", "silu_and_mul_kernel", "MLP/MoE"),
            ("layers.0.mlp.experts", "fused_moe_kernel", "MLP/MoE"),
            ("layers.0.mlp.gate", "nvjet_sm90_gemm", "GEMMs"),
            ("layers.0.self_attn.o_proj", "ncclDevKernel_AllReduce_Sum_bf16", "communication"),
            (NO_MODULE, "aten::mm", "GEMMs"),
            ("embed_tokens", "indexSelectKernel", "other"),
            (GRAPH_MODULE, "some_kernel", "other"),
            # Kernels replayed from CUDA graphs carry no module: the kernel name alone decides.
            (GRAPH_MODULE, "_fp8_gemv_kernel", "GEMMs"),
            (GRAPH_MODULE, "_moe_gemv1_kernel", "MLP/MoE"),
            (GRAPH_MODULE, "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norms"),
            (GRAPH_MODULE, "triton_poi_fused_mul_silu_split_2", "MLP/MoE"),
            (GRAPH_MODULE, "triton_per_fused_mean_3", "other"),  # a mean alone is not a norm
            # A vision tower's kernels are the encoder's, whatever they are (Qwen3.5, Kimi-K2.5, HF's names).
            ("visual.blocks.0.attn.qkv", "nvjet_sm90_gemm", "vision encoder"),
            ("model.visual.merger.norm", "rms_norm_kernel", "vision encoder"),
            ("vision_tower.encoder.blocks.1.wqkv", "ncclDevKernel_AllReduce_Sum_bf16", "vision encoder"),
            ("mm_projector.proj", "aten::addmm", "vision encoder"),
            ("model.visualizer", "aten::addmm", "GEMMs"),  # a component named so, not a prefix of one
        ],
    )
    def test_module_types(self, module, kernel, expected):
        assert module_type(module, kernel) == expected
