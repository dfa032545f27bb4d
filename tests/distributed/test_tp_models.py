"""Tensor parallelism (and expert parallelism) inside the models: two gloo ranks build the same
tiny random model, each its slice; their greedy tokens must equal HF transformers' (one rank).
All cases run in one pair of rank processes (spawning them costs more than the models)."""
import json

import pytest
import torch

from tests.distributed.ranks import run_ranks, tp_greedy_jobs
from tests.models.test_deepseek import build_tiny_deepseek
from tests.models.harness import hf_greedy

MAX_TOKENS = 8
CASES = {"llama": ("llama", False), "qwen3": ("qwen3", False), "qwen3_moe_tp": ("qwen3_moe", False),
         "qwen3_moe_ep": ("qwen3_moe", True), "llama_one_kv_head": ("kv1", False),
         "deepseek_v2_mla": ("deepseek_v2", False), "deepseek_v3_mla_ep": ("deepseek_v3", True)}


def _prompts(path):
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 9, 40)]


def _one_kv_head_llama(path):
    """One kv head over two ranks (each keeps a copy); an odd vocabulary splits unevenly."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.15) if p.dim() > 1 else p.copy_(1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def tp_results(tiny_dist_models, tmp_path_factory):
    paths = {arch: tiny_dist_models(arch) for arch in ("llama", "qwen3", "qwen3_moe")}
    paths["kv1"] = _one_kv_head_llama(tmp_path_factory.mktemp("kv1"))
    for version in ("v2", "v3"):  # MLA: q and kv_b heads split, the latent replicated
        paths[f"deepseek_{version}"] = build_tiny_deepseek(tmp_path_factory.mktemp(f"ds_{version}"), version)
    jobs = [(paths[arch], _prompts(paths[arch]), MAX_TOKENS, ep, 16) for arch, ep in CASES.values()]
    ranks = run_ranks(2, tp_greedy_jobs, jobs)
    return paths, dict(zip(CASES, zip(*ranks)))


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_greedy_equals_hf(tp_results, case):
    from transformers import AutoModelForCausalLM

    paths, results = tp_results
    path = paths[CASES[case][0]]
    rank0, rank1 = results[case]
    assert rank0 == rank1, "the ranks sampled different tokens"
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert rank0 == hf_greedy(model, _prompts(path), MAX_TOKENS)
