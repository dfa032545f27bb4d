"""Shared engine options: values the user set, plus ATOM_* profiling defaults from atom_core.envs."""
import pytest

from atomctl.engine_options import ENGINE_OPTIONS, engine_kwargs


def _defaults(**overrides):
    values = {name: option.default for name, (_, option) in ENGINE_OPTIONS.items()}
    values.update(overrides)
    return values


def test_only_changed_options_are_passed(monkeypatch):
    for var in ("ATOM_TORCH_PROFILER_DIR", "ATOM_MARK_TRACE", "ATOM_PROFILER_DETAILED"):
        monkeypatch.delenv(var, raising=False)
    kwargs = engine_kwargs(_defaults(model="/m", max_num_seqs=8, cudagraph_capture_sizes="1, 2,4"))
    assert kwargs == {"model": "/m", "max_num_seqs": 8, "cudagraph_capture_sizes": (1, 2, 4)}


def test_profiling_env_vars_fill_unset_options(monkeypatch):
    monkeypatch.setenv("ATOM_TORCH_PROFILER_DIR", "/tmp/traces")
    monkeypatch.setenv("ATOM_MARK_TRACE", "1")
    monkeypatch.setenv("ATOM_PROFILER_DETAILED", "yes")
    kwargs = engine_kwargs(_defaults(model="/m"))
    assert kwargs["torch_profiler_dir"] == "/tmp/traces" and kwargs["mark_trace"] and kwargs["profiler_detailed"]
    assert engine_kwargs(_defaults(model="/m", torch_profiler_dir="/x"))["torch_profiler_dir"] == "/x"


def test_malformed_env_value_is_an_error(monkeypatch):
    monkeypatch.setenv("ATOM_MARK_TRACE", "maybe")
    with pytest.raises(ValueError, match="ATOM_MARK_TRACE"):
        engine_kwargs(_defaults(model="/m"))
