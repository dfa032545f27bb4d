"""--method mtp on DeepSeek-V3.2 / GLM-5: the nextn layer is a sparse-attention MLA + MoE block
with its own lightning indexer (GLM-5's too: `indexer_types` covers the decoder layers only).
Tiny random checkpoints (index_topk 8, prompts far longer) with a nextn layer appended in the
checkpoint layout: greedy output equals plain decoding, chunked prefill included; the nextn
layer caches its indexer keys beside its latent."""
from __future__ import annotations

import json

import pytest
import torch

from atom_core import LLMEngine, SamplingParams
from atom_core.model_ops.kv_spec import attention_layers
from tests.models.test_deepseek_v32 import build_tiny_dsa
from tests.spec_decode.mtp_models import append_nextn_tensors

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPT_LENS = [3, 20, 45]


@pytest.fixture(scope="module", params=["v32", "glm5"])
def dsa_mtp(request, tmp_path_factory):
    """(path, prompts, plain greedy tokens): 3 HF layers, the last one becoming the nextn layer."""
    path = build_tiny_dsa(tmp_path_factory.mktemp(f"dsa_mtp_{request.param}"), request.param, num_layers=3)
    append_nextn_tensors(path, 2)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
    plain = [o["token_ids"] for o in LLMEngine(str(path)).generate(prompts, GREEDY)]
    return path, prompts, plain


@pytest.mark.parametrize("options", [
    {"num_speculative_tokens": 1},
    {"num_speculative_tokens": 3, "max_num_batched_tokens": 16},  # chunked prefill beside verify steps
], ids=["k1", "k3-chunked"])
def test_greedy_equals_plain_decoding(dsa_mtp, options):
    path, prompts, plain = dsa_mtp
    engine = LLMEngine(str(path), method="mtp", **options)
    assert [o["token_ids"] for o in engine.generate(prompts, GREEDY)] == plain
    stats = engine.spec_decode_stats()
    assert stats["num_drafts"] > 0 and len(stats["accepted_per_position"]) == options["num_speculative_tokens"]
    assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks


def test_nextn_layer_runs_its_own_indexer(dsa_mtp):
    """The drafter's layer is sparse with an indexer key cache, and it wrote keys there."""
    path, prompts, _ = dsa_mtp
    engine = LLMEngine(str(path), method="mtp", num_speculative_tokens=1)
    engine.generate(prompts[1:2], GREEDY)
    [layer] = attention_layers(engine.core.executor.runner.proposer.model)
    assert layer.has_indexer and layer.kv_spec.index_head_dim == 32
    assert layer.index_cache.abs().sum() > 0
