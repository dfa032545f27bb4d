"""Plugin mode on CUDA with the vLLM of this interpreter (vLLM 0.20 on the GPU machine: on PYTHONPATH, with
atomctl installed beside it so vLLM lists our entry point): the tiny Qwen3, Qwen3-MoE and DeepSeek-V2
models through vllm.LLM with CUDA graphs (float32), greedy output equal to HF token for token, and
atom_core's class the one that ran."""
from __future__ import annotations

import importlib.metadata
import os
import sys

import pytest

from tests.plugin.test_vllm_plugin import (FAMILIES, LLM_KWARGS, MAX_TOKENS, assert_ours_matched_hf,  # noqa: F401
                                           models, run_driver)

pytestmark = pytest.mark.gpu

GPU_KWARGS = {**LLM_KWARGS, "enforce_eager": False, "gpu_memory_utilization": 0.3}


@pytest.fixture(scope="module")
def gpu_results(models, tmp_path_factory) -> dict:
    pytest.importorskip("vllm", reason="vLLM is not importable here (see tools/peer-vllm for the GPU machine)")
    listed = [e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins")]
    assert "atom_core.plugin:register" in listed, ("atomctl is not installed beside vLLM (pip install --no-deps "
                                                   f"--no-build-isolation -e .); vLLM lists {listed}")
    specs = [{"model": str(path), "prompts": prompts, "max_tokens": MAX_TOKENS, "llm_kwargs": GPU_KWARGS}
             for path, prompts, _ in models.values()]
    results = run_driver(sys.executable, specs, tmp_path_factory.mktemp("plugin_gpu"),
                         pythonpath=os.environ.get("PYTHONPATH", ""))
    return dict(zip(models, results))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_vllm_on_cuda_runs_our_class_and_matches_hf(gpu_results, models, family):
    assert_ours_matched_hf(gpu_results[family], models, family)
