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


def test_two_local_nodes_under_torchrun(tiny_dist_models, tmp_path):
    """torchrun on two "nodes" of this machine, one atomctl each: node 1 serves its rank only,
    node 0 generates; the text equals one rank's."""
    import os
    import shutil
    import subprocess

    from tests.server.conftest import free_port

    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH")
    model = str(tiny_dist_models("llama"))
    engine = ["--device", "cpu", "--kv-cache-memory-gb", "0.02"]
    gen = ["generate", "-m", model, *engine, "--max-tokens", "8", "--temperature", "0", "--no-chat", "hello world"]
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN}

    def node(rank, port, args):
        return [torchrun, "--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "1",
                "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "atomctl.main", *args]

    # free_port's port can be taken by a test running beside this one before torchrun binds it: then
    # (only then) the nodes start again on another port
    for _attempt in range(3):
        port = free_port()
        with open(tmp_path / "node1.log", "wb") as log:
            node1 = subprocess.Popen(node(1, port, ["serve", "-m", model, *engine, "-tp", "2"]), stdout=log,
                                     stderr=subprocess.STDOUT, env=env)
        try:
            node0 = subprocess.run(node(0, port, [*gen, "-tp", "2"]), capture_output=True, text=True, env=env,
                                   timeout=150)
            if node0.returncode != 0 and "EADDRINUSE" in node0.stderr:
                continue
            assert node0.returncode == 0, node0.stderr[-2000:]
            assert node1.wait(30) == 0, (tmp_path / "node1.log").read_text()[-2000:]
            break
        finally:
            if node1.poll() is None:
                node1.kill()
                node1.wait(10)
    else:
        pytest.fail(f"the master port was taken three times: {node0.stderr[-500:]}")
    from atom_core import LLMEngine, SamplingParams

    single = LLMEngine(model, kv_cache_memory_gb=0.02).generate("hello world", SamplingParams(temperature=0, max_tokens=8))
    assert single[0]["text"] and single[0]["text"] in node0.stdout
