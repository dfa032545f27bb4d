"""The parallelism options: CLI flags, torchrun's environment, and how they reach EngineConfig."""
import pytest
from typer.testing import CliRunner

from atom_core.config import EngineConfig
from atom_core.envs import read_torchrun_env

TORCHRUN = {"TORCHELASTIC_RUN_ID": "r", "WORLD_SIZE": "2", "GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500"}


def test_torchrun_environment_gives_the_multi_node_options():
    assert read_torchrun_env({}) == {}
    opts = read_torchrun_env(TORCHRUN)
    # torchrun's own store holds MASTER_PORT; the ranks meet one port up
    assert opts == {"nnodes": 2, "node_rank": 1, "master_addr": "10.1.2.3", "master_port": 29501}
    cfg = EngineConfig.from_kwargs("m", tensor_parallel_size=4, **opts)
    assert list(cfg.parallel.local_ranks) == [2, 3]


def test_torchrun_with_several_processes_per_node_is_refused():
    with pytest.raises(ValueError, match="--nproc-per-node 1"):
        read_torchrun_env({**TORCHRUN, "LOCAL_WORLD_SIZE": "2"})


def test_cli_flags_reach_the_engine_config(monkeypatch):
    from atomctl.engine_options import ENGINE_OPTIONS, engine_kwargs

    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    values = {name: option.default for name, (_, option) in ENGINE_OPTIONS.items()}
    values.update(model="m", tensor_parallel_size=2, enable_expert_parallel=True, nnodes=2, node_rank=1,
                  master_addr="h", master_port=1234)
    par = EngineConfig.from_kwargs(**engine_kwargs(values)).parallel
    assert (par.tensor_parallel_size, par.enable_expert_parallel, par.nnodes, par.node_rank, par.master_addr,
            par.master_port) == (2, True, 2, 1, "h", 1234)
    monkeypatch.setattr("os.environ", {**TORCHRUN})
    values.update(nnodes=None, node_rank=None, master_addr=None, master_port=None)
    par = EngineConfig.from_kwargs(**engine_kwargs(values)).parallel
    assert (par.nnodes, par.node_rank, par.master_port) == (2, 1, 29501)


def test_tp_short_flag_and_bad_value_exit_with_a_message(tiny_dist_models):
    from atomctl.main import app

    result = CliRunner().invoke(app, ["generate", "--model", str(tiny_dist_models("llama")), "--device", "cpu",
                                      "-tp", "3", "hello"])
    assert result.exit_code != 0
    assert "num_attention_heads=4 is not divisible by tensor_parallel_size=3" in result.output
