"""The engine with tensor_parallel_size=2 on the CPU (gloo): one worker process beside the
core; greedy output equals HF under chunked prefill, windows and async scheduling; bad
combinations fail before any rank starts; a dead worker fails the engine fast and clearly."""
import copy
import dataclasses
import time

import pytest
import torch

from atom_core import LLMEngine, SamplingParams
from tests.models.harness import hf_greedy

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = [[5, 6, 7], list(range(10, 60)), list(range(100, 121))]


def _hf(path):
    from transformers import AutoModelForCausalLM

    return hf_greedy(AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval(), PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("arch,options", [
    ("llama", dict(max_num_batched_tokens=32)),  # chunked prefill, decode windows, async scheduling
    ("qwen3_moe", dict(enable_expert_parallel=True, async_scheduling=False, num_scheduler_steps=1)),
])
def test_tp2_engine_equals_hf(tiny_dist_models, arch, options):
    path = tiny_dist_models(arch)
    # Every rank samples for itself (same seeds, the same gathered logits): they must agree, or
    # the workers would feed themselves other tokens than rank 0 returns.
    sampled = [SamplingParams(temperature=0.9, top_p=0.9, seed=s, max_tokens=MAX_TOKENS, ignore_eos=True)
               for s in range(len(PROMPTS))]
    single = LLMEngine(str(path), kv_cache_memory_gb=0.02,
                       **{k: v for k, v in options.items() if k != "enable_expert_parallel"})
    reference = [o["token_ids"] for o in single.generate(PROMPTS, sampled)]
    engine = LLMEngine(str(path), tensor_parallel_size=2, kv_cache_memory_gb=0.02, **options)
    try:
        outputs = engine.generate(PROMPTS, GREEDY)
        assert [o["token_ids"] for o in outputs] == _hf(path)
        assert [o["token_ids"] for o in engine.generate(PROMPTS, sampled)] == reference
        assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks
    finally:
        engine.shutdown()
    assert all(p.poll() is not None for p in engine.core.executor.workers.values())


@pytest.mark.parametrize("options,message", [
    (dict(tensor_parallel_size=3), "num_attention_heads=4 is not divisible by tensor_parallel_size=3"),
    (dict(enable_expert_parallel=True), "needs tensor_parallel_size > 1"),
    (dict(tensor_parallel_size=2, enable_expert_parallel=True), "needs a mixture-of-experts model"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size=0"),
    (dict(tensor_parallel_size=2, nnodes=2), "master_port"),
    (dict(tensor_parallel_size=3, nnodes=2, master_port=5000), "must divide tensor_parallel_size=3"),
    (dict(nnodes=2, node_rank=2, tensor_parallel_size=2, master_port=5000), "node_rank"),
])
def test_bad_combinations_fail_at_start(tiny_dist_models, options, message):
    with pytest.raises(ValueError, match=message):
        LLMEngine(str(tiny_dist_models("llama")), **options)


def test_experts_must_divide_for_expert_parallel(tiny_dist_models):
    from atom_core.config import ModelConfig, ParallelConfig
    from atom_core.distributed.checks import check_parallel
    from atom_core.loader import resolve_model, resolve_model_files

    path = tiny_dist_models("qwen3_moe")
    model = resolve_model(ModelConfig(str(path)), resolve_model_files(str(path)))
    hf = copy.deepcopy(model.hf_config)
    hf.num_experts = 6
    with pytest.raises(ValueError, match="6 experts are not divisible by tensor_parallel_size=4"):
        check_parallel(ParallelConfig(tensor_parallel_size=4, enable_expert_parallel=True),
                       dataclasses.replace(model, hf_config=hf))
    on_gpu = dataclasses.replace(model, device=torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"needs 2 GPUs on this node; it has \d"):
        check_parallel(ParallelConfig(tensor_parallel_size=2), on_gpu)


def test_killed_worker_fails_the_engine_fast(tiny_dist_models):
    from atom_core.worker.multiproc_executor import WorkerDiedError

    engine = LLMEngine(str(tiny_dist_models("llama")), tensor_parallel_size=2, kv_cache_memory_gb=0.02)
    try:
        engine.generate([[5, 6, 7]], GREEDY)
        engine.core.executor.workers[1].kill()
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"tensor-parallel worker rank 1 \(pid \d+\) exited with code -9"):
            engine.generate(PROMPTS, GREEDY)
        assert time.monotonic() - start < 10
    finally:
        engine.shutdown()
