"""DeepSeek-V3.2 and GLM-5 under tensor parallelism: two gloo ranks build the tiny sparse-attention
models, each with its half of the MLA heads and experts and the whole (replicated) indexer, so both
ranks select the same tokens; with chunked prefill, their greedy tokens equal HF transformers'."""
from __future__ import annotations

import json

import pytest
import torch

from tests.distributed.ranks import run_ranks, tp_greedy_jobs
from tests.models.harness import hf_greedy, random_prompts
from tests.models.test_deepseek_v32 import INDEX_TOPK, build_tiny_dsa

PROMPT_LENS = [40, 13, 3]  # two prompts past index_topk (the selection drops tokens), one under it
MAX_TOKENS = 6
FAMILIES = ("v32", "glm5")


def _indexer_weights(path) -> dict:
    """Every rank's indexer parameters, to check they are whole (not split over the ranks)."""
    from transformers import AutoConfig

    from atom_core.loader import build_model

    model = build_model(AutoConfig.from_pretrained(str(path)), path, torch.float32, "cpu")
    return {name: p.detach().numpy() for name, p in model.named_parameters() if ".indexer." in name}


def _rank_job(jobs: list[tuple], path) -> tuple:
    return tp_greedy_jobs(jobs), _indexer_weights(path)


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    paths = {f: build_tiny_dsa(tmp_path_factory.mktemp(f"dsa_tp_{f}"), f) for f in FAMILIES}
    prompts = {f: random_prompts(json.loads((paths[f] / "config.json").read_text())["vocab_size"], PROMPT_LENS)
               for f in FAMILIES}
    jobs = [(paths[f], prompts[f], MAX_TOKENS, False, 16) for f in FAMILIES]  # chunks of 16: chunked prefill
    ranks = run_ranks(2, _rank_job, jobs, paths["v32"])
    return paths, prompts, ranks


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_greedy_equals_hf(tp_results, family):
    from transformers import AutoModelForCausalLM

    paths, prompts, ranks = tp_results
    (rank0, _), (rank1, _) = ranks
    i = FAMILIES.index(family)
    assert rank0[i] == rank1[i], "the ranks sampled different tokens"
    assert max(PROMPT_LENS) > INDEX_TOPK
    hf = AutoModelForCausalLM.from_pretrained(str(paths[family]), dtype=torch.float32).eval()
    assert rank0[i] == hf_greedy(hf, prompts[family], MAX_TOKENS)


def test_indexer_is_replicated(tp_results):
    from safetensors.torch import load_file

    paths, _, ranks = tp_results
    checkpoint = load_file(str(paths["v32"] / "model.safetensors"))
    (_, weights0), (_, weights1) = ranks
    assert weights0 and weights0.keys() == weights1.keys()
    for name, value in weights0.items():
        whole = checkpoint[name].numpy()
        assert value.shape == whole.shape and (value == whole).all() and (weights1[name] == whole).all(), name
