"""cache_salt (vLLM's): the prefix cache parts requests by salt (the server's side: tests/server/
test_openai_api.py); outputs do not change; a bad salt is a clear error naming it."""
from __future__ import annotations

import pytest

from atom_core import LLMEngine, SamplingParams
from atom_core.engine.sequence import Sequence
from atom_core.lora import LoRARequest

LONG = list(range(5, 5 + 40))  # more than two 16-token blocks


def _params(salt: str | None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, cache_salt=salt)


def test_only_the_same_salt_hits_and_outputs_do_not_change(tiny_llama):
    llm = LLMEngine(str(tiny_llama), num_kv_blocks=64)
    plain = llm.generate([LONG], _params(None))[0]["token_ids"]
    hits = []
    for salt in ["a", "b", "a", None]:
        before = llm.core.kv.num_hit_tokens
        assert llm.generate([LONG], _params(salt))[0]["token_ids"] == plain, salt
        hits.append(llm.core.kv.num_hit_tokens - before)
    assert hits == [0, 0, 32, 32]  # "a" again and unsalted again: their own two full blocks


def test_a_salt_and_an_adapter_seed_the_chain_together():
    lora = LoRARequest("x", 1, "/nowhere")
    seeds = {Sequence("r", [1], SamplingParams(cache_salt=salt, lora_request=adapter)).block_hash_seed
             for salt in (None, "a") for adapter in (None, lora)}
    assert len(seeds) == 4 and None in seeds


@pytest.mark.parametrize("salt, message", [("", "must be a non-empty string"), (7, "must be a non-empty string")])
def test_bad_salts_name_the_field(salt, message):
    with pytest.raises(ValueError, match=f"invalid sampling parameter cache_salt=.*{message}"):
        SamplingParams(cache_salt=salt)

