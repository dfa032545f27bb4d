"""--cudagraph-mode and --piecewise-capture-sizes: config validation, CLI parsing and errors."""
from __future__ import annotations

import pytest

from atom_core.config import EngineConfig
from atomctl.engine_options import ENGINE_OPTIONS, engine_kwargs
from tests.cli.test_generate import assert_one_line_error, invoke


def _defaults(**overrides):
    values = {name: option.default for name, (_, option) in ENGINE_OPTIONS.items()}
    values.update(overrides)
    return values


class TestConfig:
    def test_an_engine_without_graphs_keeps_full_decode_only(self):
        compile_ = EngineConfig.from_kwargs("m").compile  # the CPU captures no graphs
        assert compile_.cudagraph_mode == "full_decode_only" and compile_.piecewise_capture_sizes is None

    def test_a_gpu_engine_replays_prefills_up_to_512_tokens_by_default(self):
        from atom_core.config import DEFAULT_PIECEWISE_SIZES

        cfg = EngineConfig.from_kwargs("m", device="cuda")
        assert cfg.compile.cudagraph_mode == "full_and_piecewise" and cfg.piecewise_sizes == DEFAULT_PIECEWISE_SIZES

    @pytest.mark.parametrize("options", [{"enforce_eager": True}, {"level": 0}, {"level": 2},
                                         {"data_parallel_size": 2, "enable_expert_parallel": True,
                                          "num_scheduler_steps": 1}],
                             ids=["eager", "level0", "level2", "dp-ep"])
    def test_no_graphs_or_replicas_sharing_experts_keep_full_decode_only(self, options):
        assert EngineConfig.from_kwargs("m", device="cuda", **options).compile.cudagraph_mode == "full_decode_only"

    def test_sizes_alone_are_the_buckets_of_the_default_mode(self):
        cfg = EngineConfig.from_kwargs("m", device="cuda", piecewise_capture_sizes=[8, 16])
        assert (cfg.compile.cudagraph_mode, cfg.piecewise_sizes) == ("full_and_piecewise", (8, 16))

    def test_an_explicit_mode_wins(self):
        assert EngineConfig.from_kwargs("m", device="cuda", cudagraph_mode="full_decode_only").compile.cudagraph_mode \
            == "full_decode_only"

    @pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
    @pytest.mark.parametrize("level", [1, 3])
    def test_graph_levels_accept_the_piecewise_modes(self, mode, level):
        assert EngineConfig.from_kwargs("m", level=level, cudagraph_mode=mode).compile.cudagraph_mode == mode

    @pytest.mark.parametrize("options, fragment", [
        ({"cudagraph_mode": "full"}, "expected one of: full_decode_only, piecewise, full_and_piecewise"),
        ({"cudagraph_mode": "piecewise", "level": 0}, "needs CUDA graphs: --level 1 or 3"),
        ({"cudagraph_mode": "full_and_piecewise", "level": 2}, "needs CUDA graphs: --level 1 or 3"),
        ({"cudagraph_mode": "piecewise", "enforce_eager": True}, "without --enforce-eager"),
        ({"cudagraph_mode": "piecewise", "piecewise_capture_sizes": [8, 0]}, "positive token counts"),
        ({"cudagraph_mode": "piecewise", "piecewise_capture_sizes": []}, "positive token counts"),
        ({"piecewise_capture_sizes": [8, 16]}, "only used with --cudagraph-mode piecewise"),
    ], ids=["unknown", "level0", "level2", "enforce_eager", "zero_size", "empty_sizes", "sizes_without_mode"])
    def test_errors_name_the_option(self, options, fragment):
        with pytest.raises(ValueError, match="--cudagraph-mode|--piecewise-capture-sizes") as err:
            EngineConfig.from_kwargs("m", **options)
        assert fragment in str(err.value)

    def test_sizes_over_the_budget_leave_the_budget_itself(self):
        cfg = EngineConfig.from_kwargs("m", max_num_batched_tokens=64, cudagraph_mode="piecewise",
                                       piecewise_capture_sizes=[128, 256])
        assert cfg.piecewise_sizes == (64,)

    def test_replicas_sharing_experts_refuse_the_mode(self):
        with pytest.raises(ValueError, match="--cudagraph-mode=piecewise: .*replay full decode graphs only"):
            EngineConfig.from_kwargs("m", data_parallel_size=2, enable_expert_parallel=True, num_scheduler_steps=1,
                                     cudagraph_mode="piecewise")


class TestCli:
    def test_flags_reach_the_engine_config(self, monkeypatch):
        for var in ("ATOM_TORCH_PROFILER_DIR", "ATOM_MARK_TRACE", "ATOM_PROFILER_DETAILED"):
            monkeypatch.delenv(var, raising=False)
        kwargs = engine_kwargs(_defaults(model="/m", cudagraph_mode="full_and_piecewise",
                                         piecewise_capture_sizes="1, 8,16"))
        assert kwargs == {"model": "/m", "cudagraph_mode": "full_and_piecewise", "piecewise_capture_sizes": (1, 8, 16)}
        compile_ = EngineConfig.from_kwargs(**kwargs).compile
        assert (compile_.cudagraph_mode, compile_.piecewise_capture_sizes) == ("full_and_piecewise", (1, 8, 16))

    def test_malformed_sizes_are_an_error(self):
        with pytest.raises(ValueError, match="--piecewise-capture-sizes 'a,b'"):
            engine_kwargs(_defaults(model="/m", piecewise_capture_sizes="a,b"))

    @pytest.mark.parametrize("args, fragment", [
        (["--cudagraph-mode", "full"], "--cudagraph-mode"),
        (["--cudagraph-mode", "piecewise", "--level", "0"], "--level 1 or 3"),
        (["--cudagraph-mode", "piecewise", "--piecewise-capture-sizes", "x"], "--piecewise-capture-sizes"),
    ], ids=["unknown_mode", "level0", "malformed_sizes"])
    def test_generate_prints_one_line(self, tiny_llama, args, fragment):
        result = invoke(["generate", "--model", str(tiny_llama), "--device", "cpu", *args, "hi"])
        assert_one_line_error(result, fragment)

    def test_generate_runs_with_the_mode_on_the_cpu(self, tiny_llama):
        """The CPU runs eagerly at every level; the mode changes nothing there (and is accepted)."""
        result = invoke(["generate", "--model", str(tiny_llama), "--device", "cpu", "--num-kv-blocks", "64",
                         "--cudagraph-mode", "full_and_piecewise", "--max-tokens", "3", "--ignore-eos", "hi"])
        assert result.exit_code == 0, result.output
