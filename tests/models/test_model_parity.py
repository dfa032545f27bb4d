"""Each family against HF transformers without the engine: the model built by build_model,
driven by tests/models/harness.py (flat batches of all prompts, whole or chunked prefill, then
decode), greedy token for token and prompt logits within fp32 tolerance."""
import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from atom_core.loader import build_model
from tests.models.harness import greedy_generate, hf_greedy, prompt_logits

PROMPT_LENS = [1, 7, 20, 50, 100]
MAX_TOKENS = 16
FAMILIES = ["llama", "qwen3", "qwen3_moe", "mixtral", "glm4_moe"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    path = request.getfixturevalue(f"tiny_{request.param}")
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(99)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
    hf_model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    model = build_model(AutoConfig.from_pretrained(str(path)), path, torch.float32, "cpu")
    return model, hf_model, prompts, hf_greedy(hf_model, prompts, MAX_TOKENS)


def test_greedy_matches_hf(family):
    model, _, prompts, ref = family
    assert greedy_generate(model, prompts, MAX_TOKENS) == ref


def test_chunked_prefill_matches_hf(family):
    model, _, prompts, ref = family
    assert greedy_generate(model, prompts, MAX_TOKENS, chunk=16) == ref


def test_prompt_logits_match_hf(family):
    model, hf_model, prompts, _ = family
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompts[-1]])).logits[0]
    torch.testing.assert_close(prompt_logits(model, prompts[-1]), expected, rtol=1e-4, atol=1e-4)
