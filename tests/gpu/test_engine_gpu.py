"""Engine on CUDA: HF parity in float32, CUDA-graph and compiled decode equal eager decode."""
import pytest
import torch

from atom_core import LLMEngine, SamplingParams

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _prompts(n=12, vocab=300):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (int(l),), generator=g).tolist() for l in torch.randint(1, 200, (n,), generator=g)]


def _hf(path, prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    outs = []
    for p in prompts:
        ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=24, do_sample=False, pad_token_id=0)
        outs.append(ids[0, len(p):].tolist())
    return outs


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_eager_fp32_matches_hf(arch, request):
    path = request.getfixturevalue(f"tiny_{arch}")
    prompts = _prompts()
    engine = LLMEngine(str(path), device="cuda", dtype="float32", enforce_eager=True, num_kv_blocks=512,
                       max_num_batched_tokens=256)
    got = [o["token_ids"] for o in engine.generate(prompts, GREEDY)]
    assert got == _hf(path, prompts)


@pytest.mark.parametrize("level", [1, 2, 3])
def test_graphs_and_compile_equal_eager(level, tiny_qwen3):
    prompts = _prompts(20)
    common = dict(device="cuda", dtype="float32", num_kv_blocks=1024, cudagraph_capture_sizes=(1, 2, 4, 8, 16, 32))
    eager = LLMEngine(str(tiny_qwen3), enforce_eager=True, **common).generate(prompts, GREEDY)
    engine = LLMEngine(str(tiny_qwen3), level=level, **common)
    fast = engine.generate(prompts, GREEDY)
    assert [o["token_ids"] for o in fast] == [o["token_ids"] for o in eager]
    if level in (1, 3):
        full = engine.core.executor.runner.dispatcher.full
        assert full is not None and full.graphs


def test_memory_sizing_fills_budget():
    common = dict(device="cuda", load_format="dummy", max_model_len=4096, enforce_eager=True)
    small = LLMEngine("preset:Qwen3-0.6B", gpu_memory_utilization=0.2, **common)
    small_blocks = small.core.executor.num_kv_blocks
    del small
    torch.cuda.empty_cache()
    large = LLMEngine("preset:Qwen3-0.6B", gpu_memory_utilization=0.4, **common)
    total = torch.cuda.mem_get_info()[1]
    assert large.core.executor.num_kv_blocks > small_blocks > 0
    assert torch.cuda.memory_reserved() <= 0.42 * total


def test_bf16_sampling_batch_on_gpu(tiny_llama):
    # No prefix caching: a second run would otherwise prefill only the uncached tail, a different
    # computation whose bf16 rounding may legitimately flip a close sample.
    engine = LLMEngine(str(tiny_llama), device="cuda", num_kv_blocks=512, enable_prefix_caching=False)
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=i, max_tokens=16,
                             repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.1) for i in range(8)]
    a = engine.generate(_prompts(8), params)
    b = engine.generate(_prompts(8), params)
    assert [o["token_ids"] for o in a] == [o["token_ids"] for o in b]  # seeded: reproducible


@pytest.mark.parametrize("level", [0, 1, 3])
def test_multi_step_windows_equal_single_steps(level, tiny_qwen3):
    """Windows of 4 device steps (graph replays fed on the device) give the single-step tokens."""
    prompts = _prompts(20)
    params = [SamplingParams(temperature=0, max_tokens=int(n), ignore_eos=True) for n in torch.randint(1, 40, (20,))]
    common = dict(device="cuda", dtype="float32", num_kv_blocks=1024, level=level, cudagraph_capture_sizes=(1, 2, 4, 8, 16, 32))
    single = LLMEngine(str(tiny_qwen3), **common).generate(prompts, params)
    windowed = LLMEngine(str(tiny_qwen3), num_scheduler_steps=4, **common).generate(prompts, params)
    assert [o["token_ids"] for o in windowed] == [o["token_ids"] for o in single]
