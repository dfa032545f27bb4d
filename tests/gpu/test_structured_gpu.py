"""Structured outputs on CUDA: the sampler's bitmask equals xgrammar's own kernel, and the demo
model follows a JSON schema with CUDA graphs, async scheduling and decode windows on (the
grammar request samples one token per step beside a windowed free request)."""
import json

import pytest
import torch

from atom_core import LLMEngine, SamplingParams
from atom_core.loader.model_dir import DEMO_MODEL_DIR
from atom_core.structured import StructuredOutputsParams

pytestmark = pytest.mark.gpu
xgr = pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 9999},
                                           "checked": {"type": "boolean"}},
          "required": ["answer", "checked"], "additionalProperties": False}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitmask_equals_xgrammar_kernel(dtype):
    from atom_core.model_ops.sampler import apply_token_bitmask

    vocab, rows = 151_936, 64
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32, device="cuda")
    logits = torch.randn(rows, vocab, device="cuda", dtype=dtype)
    reference = logits.clone()
    xgr.apply_token_bitmask_inplace(reference, bitmask)
    assert torch.equal(apply_token_bitmask(logits, bitmask), reference)


def test_demo_model_follows_the_schema_with_graphs_and_windows():
    engine = LLMEngine(str(DEMO_MODEL_DIR), device="cuda", max_model_len=512)
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "123 + 456"}], tokenize=False,
                                                  add_generation_prompt=True)
    free, *constrained = engine.generate([prompt] * 5, [
        SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=64, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
        SamplingParams(temperature=1.0, max_tokens=64, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
        SamplingParams(temperature=0.7, seed=3, top_p=0.9, max_tokens=64, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
        SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
    ])
    assert len(free["token_ids"]) == 64
    for out in constrained[:3]:
        value = json.loads(out["text"])
        assert set(value) == {"answer", "checked"} and type(value["answer"]) is int and type(value["checked"]) is bool
    assert constrained[3]["text"] in ("yes", "no")
