"""KernelConfig (atom_core/kernel_config.py): validation, the environment as the options' default, the
build-time context layers read, kernel tables, and that kernel choices live nowhere else (no ATOM_*
read outside envs.py, no process-wide setter)."""
from __future__ import annotations

import ast
import pathlib
import re

import pytest
import torch

from atom_core.config import EngineConfig
from atom_core.envs import ENV_VARS, REMOVED_ENV_VARS, read_envs
from atom_core.kernel_config import KernelConfig, KernelTable, build_kernel_config, building

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "atom_core"


class TestValidation:
    @pytest.mark.parametrize("name, value, choices", [
        ("ep_dispatch", "nccl", "allgather, alltoall"), ("all_reduce", "mpi", "auto, nccl, symm")])
    def test_a_bad_choice_names_the_value_and_the_choices(self, name, value, choices):
        with pytest.raises(ValueError, match=f"invalid kernel option {name}='{value}' .--{name.replace('_', '-')}.; "
                                             f"expected one of: {choices}"):
            KernelConfig(**{name: value})

    @pytest.mark.parametrize("name", ["triton_fast_launch", "mtp_graphs"])
    def test_flags_must_be_booleans(self, name):
        with pytest.raises(ValueError, match=f"invalid kernel option {name}='yes'; expected true or false"):
            KernelConfig(**{name: "yes"})

    def test_defaults_and_frozen(self):
        config = KernelConfig()
        assert (config.ep_dispatch, config.all_reduce, config.triton_fast_launch, config.mtp_graphs) == (
            "allgather", "auto", True, False)
        with pytest.raises(AttributeError):
            config.ep_dispatch = "alltoall"


class TestEnvironmentLayer:
    def test_unset_variables_leave_the_defaults(self, monkeypatch):
        for name in ENV_VARS:
            monkeypatch.delenv(name, raising=False)
        assert EngineConfig.from_kwargs("m").kernel == KernelConfig()

    def test_variables_fill_options_the_keywords_leave_unset(self, monkeypatch):
        monkeypatch.setenv("ATOM_EP_DISPATCH", "alltoall")
        monkeypatch.setenv("ATOM_ALL_REDUCE", "NCCL")
        monkeypatch.setenv("ATOM_TRITON_FAST_LAUNCH", "0")
        monkeypatch.setenv("ATOM_MTP_GRAPHS", "yes")
        assert EngineConfig.from_kwargs("m").kernel == KernelConfig("alltoall", "nccl", False, True)
        kept = EngineConfig.from_kwargs("m", ep_dispatch="allgather", all_reduce="symm", triton_fast_launch=True,
                                        mtp_graphs=False).kernel
        assert kept == KernelConfig("allgather", "symm", True, False)  # a keyword (a flag) wins

    def test_a_malformed_variable_is_an_error(self, monkeypatch):
        monkeypatch.setenv("ATOM_ALL_REDUCE", "mpi")
        with pytest.raises(ValueError, match="invalid ATOM_ALL_REDUCE='mpi'; expected one of: auto, nccl, symm"):
            EngineConfig.from_kwargs("m")

    @pytest.mark.parametrize("name", REMOVED_ENV_VARS)
    def test_a_removed_variable_is_an_error_not_a_no_op(self, name):
        with pytest.raises(ValueError, match=f"{name}: removed"):
            read_envs({name: "1"})
        assert read_envs({name: " "}).ep_dispatch is None  # empty: unset

    def test_every_kept_variable_is_documented_without_measurements(self):
        for name in ("ATOM_EP_DISPATCH", "ATOM_ALL_REDUCE", "ATOM_TRITON_FAST_LAUNCH", "ATOM_MTP_GRAPHS"):
            text = ENV_VARS[name]
            assert text.startswith("default for --"), name
            assert not re.search(r"\d{4}-\d\d-\d\d|\bus\b|\bms\b|H100|tok/s|session", text), (name, text)

    def test_replace_keeps_the_kernel_part(self, monkeypatch):
        config = EngineConfig.from_kwargs("m", ep_dispatch="alltoall")
        monkeypatch.setenv("ATOM_EP_DISPATCH", "allgather")  # read at start only
        assert config.replace(max_num_seqs=4).kernel.ep_dispatch == "alltoall"


class TestBuildContext:
    def test_layers_built_inside_read_the_config_and_outside_the_defaults(self):
        chosen = KernelConfig(ep_dispatch="alltoall", triton_fast_launch=False)
        assert build_kernel_config() == KernelConfig()
        with building(chosen):
            assert build_kernel_config() is chosen
            with building(KernelConfig()):
                assert build_kernel_config() == KernelConfig()
            assert build_kernel_config() is chosen
        assert build_kernel_config() == KernelConfig()

    def test_an_attention_layer_keeps_its_config_for_its_backend(self):
        from atom_core.model_ops.attention import Attention, QKTransform
        from atom_core.model_ops.rotary import RotaryEmbedding

        qk = QKTransform(RotaryEmbedding(8, 8, 64, 10000.0))
        with building(KernelConfig(triton_fast_launch=False)):
            layer = Attention(2, 8, 1.0, 1, qk)
        assert layer.kernel_config.triton_fast_launch is False
        backend = layer.backend(torch.device("cpu"))
        assert backend.kernel == layer.kernel_config and backend is not Attention(2, 8, 1.0, 1, qk).backend("cpu")

    def test_the_runner_builds_its_model_under_the_engine_config(self, monkeypatch):
        from atom_core import LLMEngine
        from atom_core.loader.model_dir import DEMO_MODEL_DIR
        from atom_core.worker import model_runner

        seen = []
        real = model_runner.build_model
        monkeypatch.setattr(model_runner, "build_model",
                            lambda *a, **k: seen.append(build_kernel_config()) or real(*a, **k))
        engine = LLMEngine(str(DEMO_MODEL_DIR), device="cpu", triton_fast_launch=False)
        assert seen == [KernelConfig(triton_fast_launch=False)]
        layers = engine.core.executor.runner.attention_layers
        assert layers and all(layer.kernel_config.triton_fast_launch is False for layer in layers)


class TestKernelTable:
    def test_rows_by_token_count(self):
        small, large = (lambda *a: "small"), (lambda *a: "large")
        table = KernelTable(((1, small), (None, large)), torch.bfloat16)
        assert table(0) is table(1) is small and table(2) is table(10 ** 6) is large
        assert KernelTable.from_key(table.key) is table and table.dtype == torch.bfloat16

    def test_bad_rows_are_internal_errors(self):
        k = lambda *a: None  # noqa: E731
        with pytest.raises(AssertionError, match="bounds"):
            KernelTable(((4, k),))  # no row for every M
        with pytest.raises(AssertionError, match="not rising"):
            KernelTable(((4, k), (2, k), (None, k)))


class TestNoSwitchesLeft:
    def _sources(self):
        return [(p, p.read_text()) for p in PACKAGE.rglob("*.py")]

    def test_no_module_reads_atom_variables_outside_envs(self):
        pattern = re.compile(r"(os\.environ|os\.getenv|environ\.get)[^\n]*ATOM_|getenv\(\s*['\"]ATOM_")
        offenders = [str(p.relative_to(PACKAGE)) for p, text in self._sources()
                     if p.name != "envs.py" and pattern.search(text)]
        assert not offenders

    def test_read_envs_is_called_at_start_only(self):
        """config.py (EngineConfig.from_kwargs) is the one place in atom_core that parses the environment
        for kernel choices, and the vLLM plugin's load (plugin/__init__.py) in a vLLM process, which has no
        EngineConfig; the profiler and API-key variables are read by atomctl."""
        callers = sorted(str(p.relative_to(PACKAGE)) for p, text in self._sources()
                         if p.name != "envs.py" and "read_envs(" in text)
        assert callers == ["config.py", "plugin/__init__.py"]

    def test_no_process_wide_kernel_setter_remains(self):
        setters = []
        for path, text in self._sources():
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.FunctionDef) and node.name.startswith("set_") and any(
                        word in node.name for word in ("kernel", "path", "mode", "dispatch", "launch", "gemv",
                                                       "widen", "attention")):
                    if node.name not in ("set_attention_metadata",):  # the step's metadata, not a choice
                        setters.append(f"{path.relative_to(PACKAGE)}:{node.name}")
        assert not setters

    def test_no_module_level_global_statement_for_a_kernel_choice(self):
        flagged = []
        for path, text in self._sources():
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.Global):
                    flagged += [f"{path.relative_to(PACKAGE)}:{name}" for name in node.names
                                if re.search(r"kernel|mode|path|dispatch|launch|gemv|widen", name)]
        assert not flagged
