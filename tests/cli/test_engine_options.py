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


@pytest.mark.parametrize("args,steps", [([], 1), (["--num-scheduler-steps", "8"], 8), (["--num-scheduler-steps", "3"], 3)])
def test_serve_defaults_to_single_steps_but_honours_the_option(monkeypatch, args, steps):
    """Streaming clients get every token as it comes unless they ask for windows."""
    import typer
    from typer.testing import CliRunner

    import atom_core.server.app as server_app
    from atomctl.serve import register

    seen = {}
    monkeypatch.setattr(server_app, "run_server", lambda config, *a, **k: seen.update(config=config))  # returns None: exit status 0
    app = typer.Typer()
    register(app)
    app.callback()(lambda: None)
    result = CliRunner().invoke(app, ["serve", "--model", "/m", *args])
    assert result.exit_code == 0, result.output
    assert seen["config"].scheduler.num_scheduler_steps == steps


def test_offline_commands_default_to_windows_of_8():
    from atom_core.config import EngineConfig

    assert "num_scheduler_steps" not in engine_kwargs(_defaults(model="/m"))
    assert EngineConfig.from_kwargs("/m").scheduler.num_scheduler_steps == 8


def _serve_config(monkeypatch, args):
    from typer.testing import CliRunner
    import typer

    import atom_core.server.app as server_app
    from atomctl.serve import register

    seen = {}
    monkeypatch.setattr(server_app, "run_server", lambda config, *a, **k: seen.update(config=config))
    app = typer.Typer()
    register(app)
    app.callback()(lambda: None)
    result = CliRunner().invoke(app, ["serve", "--model", "/m", *args])
    return result, seen.get("config")


def test_prefill_pacing_flags_reach_the_scheduler(monkeypatch):
    result, config = _serve_config(monkeypatch, ["--prefill-pacing-steps", "16", "--prefill-pacing-min-tokens", "256"])
    assert result.exit_code == 0, result.output
    assert (config.scheduler.prefill_pacing_steps, config.scheduler.prefill_pacing_min_tokens) == (16, 256)


@pytest.mark.parametrize("args,flag", [(["--prefill-pacing-steps", "-2"], "--prefill-pacing-steps"),
                                       (["--prefill-pacing-min-tokens", "0"], "--prefill-pacing-min-tokens"),
                                       (["--prefill-pacing-min-tokens", "256"], "--prefill-pacing-min-tokens")])
def test_bad_prefill_pacing_flags_are_refused(monkeypatch, args, flag):
    result, config = _serve_config(monkeypatch, args)
    assert result.exit_code != 0 and config is None
    assert flag in result.output


def test_mixed_step_flags_reach_the_scheduler(monkeypatch):
    result, config = _serve_config(monkeypatch, ["--mixed-step-tokens-per-seq", "12", "--mixed-step-min-tokens", "384"])
    assert result.exit_code == 0, result.output
    assert (config.scheduler.mixed_step_tokens_per_seq, config.scheduler.mixed_step_min_tokens) == (12, 384)


def test_serve_caps_mixed_steps_by_default_and_its_help_says_how(monkeypatch):
    from atom_core.config import SERVE_MIXED_STEP_TOKENS_PER_SEQ
    from atomctl.engine_options import ENGINE_OPTIONS

    result, config = _serve_config(monkeypatch, [])
    assert result.exit_code == 0, result.output
    assert config.scheduler.mixed_step_tokens_per_seq == SERVE_MIXED_STEP_TOKENS_PER_SEQ > 0
    assert config.scheduler.prefill_hold_fraction == 0
    assert f"serve defaults to {SERVE_MIXED_STEP_TOKENS_PER_SEQ}" in ENGINE_OPTIONS["mixed_step_tokens_per_seq"][1].help


@pytest.mark.parametrize("args,hold,cap", [(["--mixed-step-tokens-per-seq", "8"], 0, 8),
                                           (["--mixed-step-tokens-per-seq", "0"], 0, 0),
                                           (["--prefill-pacing-steps", "16"], 0, 0),
                                           (["--prefill-pacing-steps", "0"], 0, 0),
                                           (["--prefill-hold-fraction", "0"], 0, 0),
                                           (["--prefill-hold-fraction", "0.7"], 0.7, 0),
                                           (["--no-enable-chunked-prefill"], 0, 0)])
def test_serve_keeps_its_prompt_policy_unless_one_is_chosen(monkeypatch, args, hold, cap):
    result, config = _serve_config(monkeypatch, args)
    assert result.exit_code == 0, result.output
    assert (config.scheduler.prefill_hold_fraction, config.scheduler.mixed_step_tokens_per_seq) == (hold, cap)


def test_prefill_hold_flags_reach_the_scheduler(monkeypatch):
    result, config = _serve_config(monkeypatch, ["--prefill-hold-fraction", "0.5", "--prefill-hold-max-steps", "32"])
    assert result.exit_code == 0, result.output
    assert (config.scheduler.prefill_hold_fraction, config.scheduler.prefill_hold_max_steps) == (0.5, 32)


@pytest.mark.parametrize("args,flag", [(["--prefill-hold-fraction", "-0.1"], "--prefill-hold-fraction"),
                                       (["--prefill-hold-fraction", "1.5"], "--prefill-hold-fraction"),
                                       (["--prefill-hold-max-steps", "0"], "--prefill-hold-max-steps"),
                                       (["--prefill-hold-fraction", "0", "--prefill-hold-max-steps", "8"],
                                        "--prefill-hold-max-steps"),
                                       (["--prefill-hold-fraction", "0.4", "--mixed-step-tokens-per-seq", "8"],
                                        "choose one"),
                                       (["--prefill-hold-fraction", "0.4", "--prefill-pacing-steps", "8"],
                                        "choose one")])
def test_bad_prefill_hold_flags_are_refused(monkeypatch, args, flag):
    result, config = _serve_config(monkeypatch, args)
    assert result.exit_code != 0 and config is None
    assert flag in result.output


@pytest.mark.parametrize("args,flag", [(["--mixed-step-tokens-per-seq", "-1"], "--mixed-step-tokens-per-seq"),
                                       (["--mixed-step-tokens-per-seq", "8", "--prefill-pacing-steps", "4"], "choose one"),
                                       (["--mixed-step-tokens-per-seq", "0", "--mixed-step-min-tokens", "128"],
                                        "--mixed-step-min-tokens"),
                                       (["--mixed-step-min-tokens", "0"], "--mixed-step-min-tokens")])
def test_bad_mixed_step_flags_are_refused(monkeypatch, args, flag):
    result, config = _serve_config(monkeypatch, args)
    assert result.exit_code != 0 and config is None
    assert flag in result.output


def test_offline_engines_leave_the_cap_and_the_hold_off():
    from atom_core.config import EngineConfig

    scheduler = EngineConfig.from_kwargs("/m").scheduler
    assert scheduler.mixed_step_tokens_per_seq == 0 and scheduler.prefill_hold_fraction == 0


@pytest.mark.parametrize("args, field, value", [
    (["--ep-dispatch", "alltoall"], "ep_dispatch", "alltoall"),
    (["--all-reduce", "nccl"], "all_reduce", "nccl"),
    (["--no-triton-fast-launch"], "triton_fast_launch", False),
    (["--mtp-graphs"], "mtp_graphs", True),
], ids=["ep_dispatch", "all_reduce", "triton_fast_launch", "mtp_graphs"])
def test_kernel_flags_reach_the_kernel_config(monkeypatch, args, field, value):
    for name in ("ATOM_EP_DISPATCH", "ATOM_ALL_REDUCE", "ATOM_TRITON_FAST_LAUNCH", "ATOM_MTP_GRAPHS"):
        monkeypatch.delenv(name, raising=False)
    result, config = _serve_config(monkeypatch, args)
    assert result.exit_code == 0, result.output
    assert getattr(config.kernel, field) == value
    _, default = _serve_config(monkeypatch, [])
    assert getattr(default.kernel, field) != value


def test_kernel_flags_win_over_the_environment_and_the_environment_over_the_default(monkeypatch):
    monkeypatch.setenv("ATOM_MTP_GRAPHS", "1")
    monkeypatch.setenv("ATOM_ALL_REDUCE", "symm")
    _, config = _serve_config(monkeypatch, [])
    assert config.kernel.mtp_graphs is True and config.kernel.all_reduce == "symm"
    _, config = _serve_config(monkeypatch, ["--no-mtp-graphs", "--all-reduce", "auto"])
    assert config.kernel.mtp_graphs is False and config.kernel.all_reduce == "auto"


@pytest.mark.parametrize("args, message", [
    (["--ep-dispatch", "nccl"], "ep_dispatch='nccl' (--ep-dispatch); expected one of: allgather, alltoall"),
    (["--all-reduce", "mpi"], "all_reduce='mpi' (--all-reduce); expected one of: auto, nccl, symm"),
])
def test_bad_kernel_flags_are_one_line_errors(monkeypatch, args, message):
    result, config = _serve_config(monkeypatch, args)
    assert result.exit_code != 0 and config is None
    assert message in result.output
