"""A sliding window past its length on the CPU path: a tiny Mistral with window 8 matches HF
greedy token for token, with prompts and chunks longer than the window and prefix hits past it."""
import json

import pytest
import torch

from atom_core import LLMEngine, SamplingParams
from tests.models.harness import hf_greedy
from tests.tiny_models import build_tiny_model

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path_factory.mktemp("mistral_w8"), "llama")
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=8)
    (path / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(3, cfg["vocab_size"], (21,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, cfg["vocab_size"], (n,), generator=g).tolist() for n in (1, 5, 30)]
    prompts.append(torch.randint(3, cfg["vocab_size"], (3,), generator=g).tolist())  # shorter than the window
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ref = hf_greedy(model, prompts, MAX_TOKENS)
    full = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, sliding_window=None).eval()
    assert hf_greedy(full, prompts, MAX_TOKENS) != ref, "the window must change the output for this test to mean anything"
    return path, prompts, ref


@pytest.mark.parametrize("kwargs", [{}, {"max_num_batched_tokens": 6}, {"max_num_batched_tokens": 11},
                                    {"enable_prefix_caching": True}, {"max_num_seqs": 2}],
                         ids=["default", "chunk6", "chunk11", "prefix", "seqs2"])
def test_window_8_matches_hf(windowed, kwargs):
    path, prompts, ref = windowed
    engine = LLMEngine(str(path), device="cpu", **kwargs)
    outs = engine.generate(prompts, GREEDY)
    if kwargs.get("enable_prefix_caching"):  # second pass: the 21-token shared prefix comes from the cache
        outs = engine.generate(prompts, GREEDY)
    assert [o["token_ids"] for o in outs] == ref
