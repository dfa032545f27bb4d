"""benchmarks/plugin/gpu_plugin.sh in its DRY mode (any machine, no GPU): each step prints the commands the
GPU machine would run, and a bad step or option name fails before anything runs."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from benchmarks.engine.model_dir import model_dir

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def peer(tmp_path_factory) -> dict[str, str]:
    """The paths the script checks for, as build.sh lays them out (empty: DRY runs nothing from them)."""
    root = tmp_path_factory.mktemp("peer")
    for d in ("vllm/whl", "tools/vllm_stubs"):
        (root / d).mkdir(parents=True)
    for f in ("tools/vllm_bench.py", "tools/mk_ckpt.py"):
        (root / f).touch()
    (root / "whl").mkdir()
    return {"PEER": str(root), "WHL": str(root / "whl")}


def dry(peer, tmp_path, *steps, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "benchmarks/plugin/gpu_plugin.sh", *steps], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "DRY": "1", "OUT": str(tmp_path / "out"),
                                                       "DIST": str(tmp_path / "dist"), **peer, **env})


def test_online_and_moe_steps_print_each_engine_and_checkpoint(peer, tmp_path):
    run = dry(peer, tmp_path, "online", "moe", MOE_MODELS="qwen3-30b-a3b")
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert "vllm.general_plugins: ['atom_core.plugin:register']" in lines
    on, off, atom = (next(line for line in lines if line.startswith(f"DRY: [online_{e}]")) for e in ("on", "off", "atom"))
    assert "vllm.entrypoints.cli.main serve /tmp/model-llama-3-8b" in on and "ATOM_DISABLE_VLLM_PLUGIN" not in on
    assert "ATOM_DISABLE_VLLM_PLUGIN=1" in off and "--attention-backend FLASH_ATTN" in off
    assert "atomctl.main serve --model /tmp/model-llama-3-8b --load-format dummy" in atom
    assert all("--max-concurrency 64" in line for line in (on, off, atom))
    moe = [line for line in lines if "moe_qwen3-30b-a3b" in line]
    assert [("ATOM_DISABLE_VLLM_PLUGIN=0" in m, "ATOM_DISABLE_VLLM_PLUGIN=1" in m) for m in moe] == [(True, False),
                                                                                                  (False, True)]
    assert all("CKPT_DIR=/dev/shm/ckpt-qwen3-30b-a3b" in m for m in moe)
    assert any(line.endswith("mk_ckpt.py qwen3-30b-a3b") for line in lines)
    assert lines[-1] == "DRY: rm -rf /dev/shm/ckpt-qwen3-30b-a3b"


def test_steady_step_runs_the_script_with_the_plugin_on_then_off(peer, tmp_path):
    run = dry(peer, tmp_path, "steady", STEADY_ARGS="--host --top 30")
    assert run.returncode == 0, run.stdout + run.stderr
    steady = [line for line in run.stdout.splitlines() if "[steady_" in line]
    assert [line.split("]")[0] for line in steady] == ["DRY: [steady_on, 200s", "DRY: [steady_off, 200s"]
    assert "ATOM_DISABLE_VLLM_PLUGIN=0" in steady[0] and "ATOM_DISABLE_VLLM_PLUGIN=1" in steady[1]
    assert all(line.endswith("steady_steps.py /tmp/model-llama-3-8b --host --top 30") for line in steady)


def test_online_engines_picks_the_servers(peer, tmp_path):
    run = dry(peer, tmp_path, "online", ONLINE_ENGINES="atom")
    assert run.returncode == 0, run.stdout + run.stderr
    assert [line.split("]")[0] for line in run.stdout.splitlines() if "[online_" in line] == ["DRY: [online_atom"]


@pytest.mark.parametrize("steps,env,message", [
    (("bench", "bogus"), {}, "unknown step bogus (parity, bench, online, moe, steady)"),
    (("online",), {"ONLINE_ENGINES": "on sglang"}, "ONLINE_ENGINES: on, off and/or atom, not sglang"),
    (("moe",), {"BENCH_MODES": "both"}, "BENCH_MODES: on and/or off, not both"),
])
def test_bad_names_fail_clearly(peer, tmp_path, steps, env, message):
    run = dry(peer, tmp_path, *steps, **env)
    assert run.returncode == 3 and f"gpu_plugin.sh: {message}" in run.stdout
    assert "DRY:" not in run.stdout and "dist-info" not in run.stdout  # refused before anything ran


def test_missing_peer_files_are_named(peer, tmp_path):
    run = dry(peer, tmp_path, "bench", PEER=str(tmp_path / "nowhere"))
    assert run.returncode == 3 and "missing" in run.stdout and "nowhere/vllm/whl" in run.stdout


def test_model_dir_gives_a_preset_a_word_level_tokenizer(tmp_path):
    directory = model_dir("preset:Qwen3-0.6B", tmp_path / "m")
    config = json.loads((directory / "config.json").read_text())
    vocab = json.loads((directory / "tokenizer.json").read_text())["model"]["vocab"]
    assert len(vocab) == config["vocab_size"] and vocab["t5"] == 5
    assert json.loads((directory / "tokenizer_config.json").read_text())["eos_token"] == "t1"
