"""Multi-LoRA through LLMEngine on a tiny random llama: every adapter's greedy tokens equal HF
transformers + PEFT; mixed steps, eviction, run-time loading and unloading, and the prefix cache."""
from __future__ import annotations

import pytest
import torch

from atom_core.engine.llm_engine import LLMEngine
from atom_core.sampling_params import SamplingParams
from tests.lora.adapters import hf_greedy

MAX_TOKENS = 6
PROMPTS = [[5, 17, 33, 80, 120, 7], [200, 3, 3, 91, 44, 12, 8, 150, 61, 9, 27]]
LONG = list(range(40, 80))  # over two KV blocks: a prefix-cache hit is possible
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SETTINGS = {
    "defaults": {},
    "chunked_prefill": {"max_num_batched_tokens": 8},
    "no_prefix_caching": {"enable_prefix_caching": False},
    "max_num_seqs_2": {"max_num_seqs": 2},
}


@pytest.fixture(scope="module")
def expected(lora_base, adapters):
    """HF + PEFT greedy tokens per (adapter or None, prompt index); LONG is index -1."""
    out = {}
    for name in [None, *adapters]:
        path = adapters[name] if name else None
        *short, long = hf_greedy(lora_base, path, [*PROMPTS, LONG], MAX_TOKENS)
        out |= {(name, i): tokens for i, tokens in enumerate(short)}
        out[name, -1] = long
    return out


def _engine(lora_base, adapters, **options):
    modules = [f"{name}={path}" for name, path in adapters.items()]
    options = {"enable_lora": True, "lora_modules": modules, "max_loras": 2, "num_kv_blocks": 64, **options}
    return LLMEngine(str(lora_base), **options)


def _run_mixed(llm, jobs):
    """Add every (prompt, adapter) job at once, step to the end; tokens per job, and the largest
    number of distinct adapters any step's running set held."""
    ids = [llm.add_request(prompt, GREEDY, lora=name)[0] for prompt, name in jobs]
    done, widest = {}, 0
    while not llm.is_finished():
        for state in llm.step():
            if state.finished:
                done[state.request_id] = state.as_dict()["token_ids"]
        widest = max(widest, len({s.lora_int_id for s in llm.core.scheduler.running} - {None}))
    return [done[i] for i in ids], widest


@pytest.mark.parametrize("setting", SETTINGS)
def test_each_adapter_matches_hf_peft(lora_base, adapters, expected, setting):
    llm = _engine(lora_base, adapters, **SETTINGS[setting])
    for name in [None, *adapters]:
        got = [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, lora=name)]
        assert got == [expected[name, i] for i in range(len(PROMPTS))], name
    assert llm.core.kv.num_free_blocks == llm.core.kv.num_blocks


def test_one_step_mixing_three_adapters_and_the_base_equals_each_alone(lora_base, adapters, expected):
    llm = _engine(lora_base, adapters, max_loras=3)
    jobs = [(PROMPTS[i % 2], name) for i, name in enumerate([None, "all8", "attn4rs", "mlp16", "mlp16", None])]
    got, widest = _run_mixed(llm, jobs)
    assert widest == 3  # the three adapters ran side by side
    assert got == [expected[name, i % 2] for i, (_, name) in enumerate(jobs)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("options", [{}, {"enforce_eager": True}], ids=["graphs", "eager"])
def test_cuda_mixed_steps_match_hf_peft(lora_base, adapters, expected, options):
    """The Triton shrink/expand kernels inside the engine on CUDA (fp32), decode steps replaying graphs
    whose per-token adapter layout changes every step: three adapters and the base at once equal HF + PEFT
    on the CPU; eagerly too."""
    llm = _engine(lora_base, adapters, max_loras=3, device="cuda", dtype="float32", **options)
    jobs = [(PROMPTS[i % 2], name) for i, name in enumerate([None, "all8", "attn4rs", "mlp16", "all8", None])]
    got, widest = _run_mixed(llm, jobs)
    assert widest == 3
    assert got == [expected[name, i % 2] for i, (_, name) in enumerate(jobs)]


def test_eviction_with_one_slot_loses_no_request(lora_base, adapters, expected):
    llm = _engine(lora_base, adapters, max_loras=1, max_cpu_loras=1)
    jobs = [(PROMPTS[0], name) for name in ["all8", "attn4rs", "mlp16", None, "all8"]]
    got, widest = _run_mixed(llm, jobs)
    assert widest == 1  # the scheduler never ran two adapters at once
    assert got == [expected[name, 0] for _, name in jobs]
    slots = llm.core.executor.runner.lora
    assert slots.num_slot_writes >= 3 and slots.num_disk_reads >= 3  # evicted from the GPU and the CPU cache


def test_load_and_unload_while_requests_run(lora_base, adapters, expected):
    llm = _engine(lora_base, {"all8": adapters["all8"]})
    rid = llm.add_request(PROMPTS[1], GREEDY, lora="all8")[0]
    llm.step()
    llm.unload_lora("all8")  # the running request keeps its adapter
    with pytest.raises(ValueError, match="unknown LoRA adapter 'all8'"):
        llm.add_request(PROMPTS[0], GREEDY, lora="all8")
    llm.load_lora("late", str(adapters["mlp16"]))
    late = llm.add_request(PROMPTS[0], GREEDY, lora="late")[0]
    done = {}
    while not llm.is_finished():
        done |= {s.request_id: s.as_dict()["token_ids"] for s in llm.step() if s.finished}
    assert done[rid] == expected["all8", 1] and done[late] == expected["mlp16", 0]
    with pytest.raises(KeyError, match="no LoRA adapter named 'all8'"):
        llm.unload_lora("all8")


def test_prefix_cache_is_not_shared_across_adapters(lora_base, adapters, expected):
    llm = _engine(lora_base, adapters)
    for name in ["all8", "attn4rs", None, "all8"]:
        out = llm.generate([LONG], GREEDY, lora=name)[0]
        assert out["token_ids"] == expected[name, -1], name
    assert llm.core.kv.num_hit_tokens == 32  # only the second all8 run hit (its own two blocks)


def test_lora_needs_enable_lora(lora_base):
    llm = LLMEngine(str(lora_base), num_kv_blocks=16)
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate(PROMPTS, GREEDY, lora="all8")
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.load_lora("x", "/nowhere")
