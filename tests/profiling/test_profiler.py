"""TorchProfiler, mark_modules, envs, and a real CPU profiling run parsed with the CPU rule."""
from __future__ import annotations

import dataclasses
import gzip
import json
import re

import pandas as pd
import pytest
import torch
import typer
from torch import nn
from torch.profiler import record_function
from typer.testing import CliRunner

from atom_core.envs import AtomEnvs, read_envs
from atom_core.profiling.breakdown import BREAKDOWN_COLUMNS, parse_trace
from atom_core.profiling.conventions import step_range_name
from atom_core.profiling.profiler import (
    NO_DIR_MESSAGE,
    ProfilerConfig,
    TorchProfiler,
    mark_modules,
    rank_dir_name,
    sanitize_model_name,
)
from atom_core.profiling.report import write_workbooks
from atom_core.profiling.trace_parser import NO_MODULE
from atomctl.profile import register

NUM_LAYERS = 4
HIDDEN = 16


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv_proj = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        return self.o_proj(torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v)


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.act_fn = nn.SiLU()
        self.down_proj = nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(HIDDEN)
        self.self_attn = Attn()
        self.post_attention_layernorm = nn.LayerNorm(HIDDEN)
        self.mlp = Mlp()

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(64, HIDDEN)
        self.layers = nn.ModuleList(Layer() for _ in range(NUM_LAYERS))

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return x


class TinyLM(nn.Module):
    """The module tree of atom_core's models: model.embed_tokens, model.layers.N..., lm_head."""

    def __init__(self):
        super().__init__()
        self.model = Decoder()
        self.lm_head = nn.Linear(HIDDEN, 64)

    def forward(self, ids):
        return self.lm_head(self.model(ids))


def _trace_events(path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _range_names(path) -> set[str]:
    return {e["name"] for e in _trace_events(path) if e.get("cat") == "user_annotation"}


class TestEnvs:
    def test_empty_environment_gives_defaults(self):
        assert read_envs({}) == AtomEnvs()

    def test_values_are_parsed(self):
        env = {"ATOM_TORCH_PROFILER_DIR": "/tmp/traces", "ATOM_PROFILER_DETAILED": "1", "ATOM_MARK_TRACE": "TRUE"}
        assert read_envs(env) == AtomEnvs("/tmp/traces", profiler_detailed=True, mark_trace=True)
        assert read_envs({"ATOM_MARK_TRACE": "0", "ATOM_TORCH_PROFILER_DIR": ""}) == AtomEnvs()

    @pytest.mark.parametrize("name", ["ATOM_PROFILER_DETAILED", "ATOM_MARK_TRACE"])
    def test_malformed_bool_names_the_variable(self, name):
        with pytest.raises(ValueError, match=rf"invalid {name}='maybe'"):
            read_envs({name: "maybe"})

    def test_envs_are_frozen(self):
        with pytest.raises(dataclasses.FrozenInstanceError):
            read_envs({}).mark_trace = True


class TestNames:
    def test_rank_dir_name(self):
        assert rank_dir_name(0) == "rank_0"
        assert rank_dir_name(3, dp_rank=1) == "dp1_tp3"

    @pytest.mark.parametrize(
        "model, expected",
        [("Qwen/Qwen3-8B", "Qwen_Qwen3-8B"), ("/models/Llama-3.1-8B/", "Llama-3.1-8B"), ("preset:llama3-8b", "preset_llama3-8b")],
    )
    def test_sanitize_model_name(self, model, expected):
        assert sanitize_model_name(model) == expected


class TestTorchProfiler:
    def test_start_without_dir_is_a_clear_error(self):
        with pytest.raises(ValueError) as err:
            TorchProfiler(ProfilerConfig(), "m").start()
        assert str(err.value) == NO_DIR_MESSAGE

    def test_stop_without_start_is_an_error(self, tmp_path):
        with pytest.raises(ValueError, match="not running"):
            TorchProfiler(ProfilerConfig(str(tmp_path)), "m").stop()

    def test_writes_a_gzip_trace_in_the_rank_dir(self, tmp_path):
        profiler = TorchProfiler(ProfilerConfig(str(tmp_path)), "org/My Model", rank_dir=rank_dir_name(1, dp_rank=0))
        profiler.start()
        assert profiler.is_active
        with pytest.raises(ValueError, match="already running"):
            profiler.start()
        with record_function("hello"):
            torch.ones(4).sum()
        (path,) = profiler.stop()
        assert not profiler.is_active
        assert re.fullmatch(rf"{tmp_path}/dp0_tp1/org_My_Model_\d{{8}}_\d{{6}}_\d{{3}}\.pt\.trace\.json\.gz", path)
        assert "hello" in _range_names(path)

    def test_graph_capture_is_recorded_only_with_mark_trace(self, tmp_path):
        plain = TorchProfiler(ProfilerConfig(str(tmp_path / "plain")), "m")
        assert plain.record_graph_capture(4, lambda: "graph") == "graph"
        assert plain.capture_trace_paths == [] and not (tmp_path / "plain").exists()

        marked = TorchProfiler(ProfilerConfig(str(tmp_path / "marked"), mark_trace=True), "m")
        assert marked.record_graph_capture(4, lambda: torch.ones(2).sum()) == 2
        (path,) = marked.capture_trace_paths
        assert re.fullmatch(rf"{tmp_path}/marked/rank_0/capture_bs4_m_\d{{8}}_\d{{6}}_\d{{3}}\.pt\.trace\.json\.gz", path)
        assert "atom_graph_capture bs=4" in _range_names(path)

    def test_graph_capture_during_a_session_lands_in_its_trace(self, tmp_path):
        profiler = TorchProfiler(ProfilerConfig(str(tmp_path), mark_trace=True), "m")
        profiler.start()
        profiler.record_graph_capture(8, lambda: None)
        (path,) = profiler.stop()
        assert "atom_graph_capture bs=8" in _range_names(path)
        assert profiler.capture_trace_paths == []


class TestMarkModules:
    def test_ranges_carry_qualified_names_without_the_model_prefix(self, tmp_path):
        model = TinyLM()
        mark_modules(model)
        profiler = TorchProfiler(ProfilerConfig(str(tmp_path)), "tiny")
        profiler.start()
        model(torch.tensor([[1, 2, 3]]))
        names = _range_names(profiler.stop()[0])
        assert {"layers.3.self_attn.qkv_proj", "layers.0.mlp.act_fn", "layers.2", "embed_tokens", "lm_head", "model"} <= names
        assert not any(n.startswith("model.") for n in names)

    def test_no_ranges_and_same_output_without_a_profiler(self):
        torch.manual_seed(0)
        model = TinyLM()
        ids = torch.tensor([[1, 2, 3]])
        expected = model(ids)
        handles = mark_modules(model)
        assert torch.equal(model(ids), expected)
        for h in handles:
            h.remove()
        assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())

    def test_a_failing_forward_closes_its_ranges(self, tmp_path):
        model = TinyLM()
        mark_modules(model)
        profiler = TorchProfiler(ProfilerConfig(str(tmp_path)), "tiny")
        profiler.start()
        with pytest.raises(IndexError):
            model(torch.tensor([[999]]))  # out of the embedding's range
        model(torch.tensor([[1]]))  # a balanced stack: the next forward nests nowhere odd
        names = _range_names(profiler.stop()[0])
        assert "layers.3.mlp.down_proj" in names


@pytest.fixture(scope="module")
def cpu_trace(tmp_path_factory):
    """A real profiled CPU run: one prefill step and three decode steps of TinyLM."""
    torch.manual_seed(0)
    model = TinyLM().eval()
    mark_modules(model)
    out = tmp_path_factory.mktemp("traces")
    profiler = TorchProfiler(ProfilerConfig(str(out), mark_trace=True), "tiny-lm")
    with torch.inference_mode():
        model(torch.zeros(2, 8, dtype=torch.long))  # warm-up outside the session
        profiler.start()
        with record_function(step_range_name("prefill", 2, 16)):
            model(torch.randint(0, 64, (2, 8)))
        for _ in range(3):
            with record_function(step_range_name("decode", 2, 2)):
                model(torch.randint(0, 64, (2, 1)))
        (path,) = profiler.stop()
    return out, path


class TestCpuRun:
    def test_trace_is_written_in_rank_0(self, cpu_trace):
        out, path = cpu_trace
        assert path.startswith(f"{out}/rank_0/tiny-lm_") and path.endswith(".pt.trace.json.gz")

    def test_cpu_trace_parses_with_the_cpu_rule(self, cpu_trace, tmp_path):
        _, path = cpu_trace
        result = parse_trace(path, layer=3)
        assert result.uses_cpu_rule
        assert result.notes == []
        for phase in ("prefill", "decode"):
            pb = result.phases[phase]
            layer = pb.layer_table
            assert len(layer) > 0
            assert layer["cpu_module"].str.fullmatch(r"layers\.3(\..*)?").all()
            assert (layer["duration_us"] >= 0).all() and layer["duration_us"].sum() > 0
            assert layer["gpu_kernel"].str.startswith("aten::").all()
            assert {"layers.3.self_attn.qkv_proj", "layers.3.mlp.down_proj"} <= set(layer["cpu_module"])
            qkv = layer[layer["cpu_module"] == "layers.3.self_attn.qkv_proj"]
            assert qkv["gpu_kernel"].isin(["aten::addmm", "aten::mm"]).any()  # the matmul itself, by self time
        assert result.phases["decode"].num_steps == 3
        for path_ in write_workbooks(result, tmp_path):
            sheets = pd.read_excel(path_, sheet_name=None)
            table = sheets["layer_3"]
            assert list(table.columns) == BREAKDOWN_COLUMNS
            group = (table["cpu_module"] != table["cpu_module"].shift()).cumsum()
            assert list(table.groupby(group)["sum per module"].first()) == pytest.approx(
                list(table.groupby(group)["duration_us"].sum())
            )

    def test_ops_outside_modules_are_kept(self, cpu_trace):
        _, path = cpu_trace
        full = parse_trace(path).phases["prefill"].sheets["full_step"]
        # torch.randint runs inside the step but outside every module
        assert {"embed_tokens", "lm_head", NO_MODULE} <= set(full["cpu_module"])
        assert set(full[full["cpu_module"] == NO_MODULE]["gpu_kernel"]) <= {"aten::randint", "aten::random_", "aten::empty"}


@pytest.mark.gpu
def test_replayed_graph_kernels_get_the_modules_of_eager_kernels(tmp_path):
    """On a GPU: kernels replayed from a CUDA graph, attributed through the capture trace,
    match (module and kernel, in order) the same decode step run eagerly."""
    torch.manual_seed(0)
    model = TinyLM().cuda().eval()
    mark_modules(model)
    profiler = TorchProfiler(ProfilerConfig(str(tmp_path), mark_trace=True), "tiny")
    ids = torch.randint(0, 64, (2, 1), device="cuda")
    graph = torch.cuda.CUDAGraph()

    def capture():
        with torch.cuda.graph(graph):
            return model(ids)

    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model(ids)  # warm-up before capture
        torch.cuda.current_stream().wait_stream(side)
        profiler.record_graph_capture(2, capture)
        profiler.start()
        with record_function(step_range_name("prefill", 2, 16)):
            model(torch.randint(0, 64, (2, 8), device="cuda"))
        with record_function(step_range_name("decode", 2, 2)):
            model(ids)
        for _ in range(2):
            with record_function(step_range_name("decode", 2, 2, graph_bs=2)):
                graph.replay()
        torch.cuda.synchronize()
        (path,) = profiler.stop()
    result = parse_trace(path)
    assert not result.uses_cpu_rule and result.notes == []
    decode = result.phases["decode"]
    assert decode.num_steps_averaged == 3  # eager and replayed steps share one kernel sequence
    assert {"layers.3.self_attn.qkv_proj", "layers.3.mlp.down_proj"} <= set(decode.layer_table["cpu_module"])


class TestProfileCommand:
    def test_profile_then_parse_trace_on_a_tiny_model(self, tiny_llama, tmp_path):
        app = typer.Typer()
        register(app)
        app.callback()(lambda: None)
        traces = tmp_path / "traces"
        args = ["profile", "--model", str(tiny_llama), "--input-length", "16", "--output-length", "4", "--bs", "2",
                "--mark-trace", "--torch-profiler-dir", str(traces)]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        (trace,) = (traces / "rank_0").glob("*.pt.trace.json.gz")
        assert f"trace: {trace}" in result.output

        out = tmp_path / "out"
        result = CliRunner().invoke(app, ["parse-trace", str(trace), "--layer", "1", "--out-dir", str(out)])
        assert result.exit_code == 0, result.output
        decode = pd.read_excel(out / "decode_breakdown.xlsx", sheet_name="layer_1")
        assert decode["cpu_module"].str.fullmatch(r"layers\.1(\..*)?").all() and len(decode) > 0
        steps = pd.read_excel(out / "decode_breakdown.xlsx", sheet_name="steps")
        assert len(steps) == 3  # 4 output tokens: the first comes from the prefill step

    def test_profile_with_an_image_shows_the_encoder_in_the_prefill(self, tmp_path):
        from tests.tiny_vlm import build_tiny_vlm, png_bytes, synthetic_image

        model = build_tiny_vlm(tmp_path / "vlm", seed=1)
        (tmp_path / "a.png").write_bytes(png_bytes(synthetic_image(11, (50, 37))))
        app = typer.Typer()
        register(app)
        app.callback()(lambda: None)
        traces = tmp_path / "traces"
        result = CliRunner().invoke(app, ["profile", "--model", str(model), "--image", str(tmp_path / "a.png"),
                                          "--output-length", "3", "--bs", "2", "--mark-trace", "--device", "cpu",
                                          "--torch-profiler-dir", str(traces)])
        assert result.exit_code == 0, result.output
        assert "input 1 image(s) and" in result.output
        (trace,) = (traces / "rank_0").glob("*.pt.trace.json.gz")
        out = tmp_path / "out"
        result = CliRunner().invoke(app, ["parse-trace", str(trace), "--layer", "0", "--out-dir", str(out)])
        assert result.exit_code == 0, result.output
        summary = pd.read_excel(out / "prefill_breakdown.xlsx", sheet_name="summary").set_index("module_type")
        assert summary.loc["vision encoder", "num_kernels"] > 0 and summary.loc["vision encoder", "duration_us"] > 0
        decode = pd.read_excel(out / "decode_breakdown.xlsx", sheet_name="summary").set_index("module_type")
        assert decode.loc["vision encoder", "num_kernels"] == 0  # decode steps encode nothing

    def test_image_copies_differ_within_and_across_runs(self, tmp_path):
        from atomctl.profile import image_copies
        from tests.tiny_vlm import png_bytes, synthetic_image

        image = png_bytes(synthetic_image(3, (20, 10)))
        copies = [c for run in (0, 1) for row in image_copies([image], 3, run) for c in row]
        assert len(set(copies)) == 6
        with pytest.raises(ValueError, match="an image of 8x4 is too small to mark 5 copies"):
            image_copies([png_bytes(synthetic_image(3, (8, 4)))], 5, 0)  # 10 numbers need 4 blocks; it has 2

    @pytest.mark.parametrize("args,message", [
        (["--image", "IMG", "--input-length", "16"], "--input-length does not apply with --image"),
        (["--image", "IMG", "--random-input"], "--random-input does not apply with --image"),
        (["--image", "MISSING"], "image file not found"),
    ])
    def test_bad_image_options_are_one_line_errors(self, tiny_llama, tmp_path, args, message):
        from tests.tiny_vlm import png_bytes, synthetic_image

        (tmp_path / "a.png").write_bytes(png_bytes(synthetic_image(3, (20, 10))))
        args = [str(tmp_path / "a.png") if a == "IMG" else str(tmp_path / "nope.png") if a == "MISSING" else a
                for a in args]
        app = typer.Typer()
        register(app)
        app.callback()(lambda: None)
        result = CliRunner().invoke(app, ["profile", "--model", str(tiny_llama), *args])
        assert result.exit_code == 1 and result.output.startswith("error: ") and message in result.output

    def test_bad_option_is_one_line_and_exit_1(self, tiny_llama, tmp_path):
        app = typer.Typer()
        register(app)
        app.callback()(lambda: None)
        result = CliRunner().invoke(app, ["profile", "--model", str(tiny_llama), "--bs", "0"])
        assert result.exit_code == 1
        assert result.output.strip() == "error: invalid --bs 0; must be >= 1"
