"""Plugin mode on CUDA, against a vLLM that is not a venv's but unpacked on a path (the GPU machine's vLLM
0.20.0): ATOM_VLLM_PYTHONPATH names that path and the directory holding our dist-info
(benchmarks/plugin/gpu_plugin.sh makes both). Tiny random dense (Llama), MoE (Qwen3-MoE) and MLA
(DeepSeek-V2) models through vllm.LLM as vLLM runs them on CUDA by default (full CUDA graphs for decode
steps, after its memory-profiling run), and the Llama once eager: greedy tokens equal HF transformers'
(float32 on the CPU, the reference of our own CUDA model tests), atom_core's class the one that ran.
With ATOM_DISABLE_VLLM_PLUGIN=1 vLLM builds its own class."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.plugin.vllm_runs import MAX_TOKENS, assert_ours_matched, build_models, run_driver

VLLM_PYTHONPATH = os.environ.get("ATOM_VLLM_PYTHONPATH", "")
pytestmark = [pytest.mark.gpu, pytest.mark.vllm_plugin,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(not VLLM_PYTHONPATH, reason="ATOM_VLLM_PYTHONPATH (vLLM + our dist-info) not set")]

FAMILIES = {  # family -> (architecture, atom_core class)
    "llama": ("LlamaForCausalLM", "atom_core.models.llama:LlamaForCausalLM"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "atom_core.models.qwen3_moe:Qwen3MoeForCausalLM"),
    "deepseek_v2": ("DeepseekV2ForCausalLM", "atom_core.models.deepseek_v2:DeepseekV2ForCausalLM"),
}
# Chunked prefill (64-token budget), prefix caching over the shared prefix, two sequences at a time (the
# others join running decodes), vLLM's own block size; a small share of the GPU, so the runs one process
# makes in turn each find their memory free, and 512 blocks (plenty for these prompts) rather than a cache
# of millions of tiny blocks.
LLM_KWARGS = dict(dtype="float32", max_model_len=512, max_num_batched_tokens=64, max_num_seqs=2, seed=0,
                  gpu_memory_utilization=0.12, num_gpu_blocks_override=512)
ENV = {"VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}  # as the GPU machine's vLLM runs (.peer/tools/run.sh)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    return build_models([*FAMILIES, "qwen3"], tmp_path_factory)


@pytest.fixture(scope="module")
def plugin_results(models, tmp_path_factory) -> dict:
    # The eager run first: a run that fails ends the process, and this one needs the least of vLLM.
    llama = models["llama"]
    specs = [{"model": str(llama[0]), "prompts": llama[1], "max_tokens": MAX_TOKENS,
              "llm_kwargs": {**LLM_KWARGS, "enforce_eager": True}}]
    specs += [{"model": str(models[f][0]), "prompts": models[f][1], "max_tokens": MAX_TOKENS, "llm_kwargs": LLM_KWARGS}
              for f in FAMILIES]
    results = run_driver(sys.executable, specs, tmp_path_factory.mktemp("plugin_cuda"), VLLM_PYTHONPATH,
                         timeout=400, **ENV)
    assert len(results) == len(specs)
    return dict(zip(["llama_eager", *FAMILIES], results))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_vllm_on_cuda_runs_our_class_with_graphs_and_matches_hf(plugin_results, models, family):
    assert_ours_matched(plugin_results[family], models, family, FAMILIES)


def test_vllm_on_cuda_runs_our_class_eager_and_matches_hf(plugin_results, models):
    assert_ours_matched(plugin_results["llama_eager"], models, "llama", FAMILIES)


def test_switched_off_vllm_on_cuda_runs_its_own_class(models, tmp_path):
    # Qwen3 (head_dim 32): vLLM's float32 attention on CUDA (Triton) takes no smaller head. Its tokens are
    # vLLM's kernels' business, not ours: only the class and that it generated are checked.
    path, prompts, _ = models["qwen3"]
    spec = {"model": str(path), "prompts": prompts[:2], "max_tokens": MAX_TOKENS,
            "llm_kwargs": {**LLM_KWARGS, "enforce_eager": True, "attention_backend": "TRITON_ATTN"}}
    (result,) = run_driver(sys.executable, [spec], tmp_path, VLLM_PYTHONPATH, timeout=300,
                           ATOM_DISABLE_VLLM_PLUGIN="1", **ENV)
    assert result["class"] == "vllm.model_executor.models.qwen3:Qwen3ForCausalLM"
    assert result["atom_class"] is None
    assert [len(t) for t in result["token_ids"]] == [MAX_TOKENS, MAX_TOKENS]
