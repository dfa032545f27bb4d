"""Tensor parallelism on two GPUs (NCCL; all-reduces through symmetric memory unless a case says
ATOM_ALL_REDUCE=nccl): TP=2 equals TP=1 in float32, eagerly and with CUDA
graphs / torch.compile around the all-reduce; expert parallelism equals the TP=1 MoE; so do two
data-parallel replicas sharing experts (DP attention + EP experts, lock-step)."""
import pytest
import torch

from atom_core import LLMEngine, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _prompts(n=12, vocab=300):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (int(l),), generator=g).tolist() for l in torch.randint(1, 200, (n,), generator=g)]


def _tokens(path, **options):
    engine = LLMEngine(str(path), device="cuda", dtype="float32", num_kv_blocks=512, max_num_batched_tokens=256,
                       **options)
    try:
        return [o["token_ids"] for o in engine.generate(_prompts(), GREEDY)]
    finally:
        engine.shutdown()


_REFERENCES: dict = {}  # model directory -> its TP=1 eager tokens, computed once


def _reference(path) -> list:
    if str(path) not in _REFERENCES:
        _REFERENCES[str(path)] = _tokens(path, enforce_eager=True)
    return _REFERENCES[str(path)]


@pytest.mark.parametrize("mode", ["symm", "nccl"])
def test_tp2_all_reduce_modes_equal_tp1(tiny_dist_models, monkeypatch, mode):
    """ATOM_ALL_REDUCE=symm (what the default, auto, picks on one host) and nccl, inside the graphs."""
    monkeypatch.setenv("ATOM_ALL_REDUCE", mode)  # the spawned workers inherit it
    path = tiny_dist_models("llama")
    assert _tokens(path, tensor_parallel_size=2, level=1) == _reference(path)


# serve's default graphs: mixed steps (prompt chunks beside decodes, <= 256 tokens here) replay
# piecewise graphs whose pieces hold the all-reduces
PIECEWISE = {"cudagraph_mode": "full_and_piecewise", "piecewise_capture_sizes": (8, 32, 128, 256)}


# One engine start at TP=2 per case, so a slow start (two workers compiling on a cold machine)
# shows which case it was; the llama cases cover eager, CUDA graphs, and compile + graphs.
@pytest.mark.parametrize("arch,extra,compile_options", [
    ("llama", {}, {"enforce_eager": True}),
    ("llama", {}, {"level": 1}),
    ("llama", {}, {"level": 3}),
    ("qwen3_moe", {}, {"level": 3}),
    ("qwen3_moe", {"enable_expert_parallel": True}, {"level": 3}),
    ("llama", {}, {"level": 3, **PIECEWISE}),
    ("qwen3_moe", {}, {"level": 3, **PIECEWISE}),
], ids=["llama-eager", "llama-graphs", "llama-compiled", "qwen3_moe-tp", "qwen3_moe-ep", "llama-piecewise",
        "qwen3_moe-piecewise"])
def test_tp2_equals_tp1_in_fp32(tiny_dist_models, arch, extra, compile_options):
    path = tiny_dist_models(arch)
    assert _tokens(path, tensor_parallel_size=2, **extra, **compile_options) == _reference(path)


# Replicas sharing experts replay decode graphs at an agreed size (the default with CUDA graphs):
# eager and compiled (level 2) run without them.
@pytest.mark.parametrize("compile_options, dp_ep_graphs", [
    ({"enforce_eager": True}, False), ({"level": 2}, False), ({"level": 1}, True), ({"level": 3}, True),
], ids=["eager", "compiled", "graphs", "compiled-graphs"])
def test_dp2_sharing_experts_equals_one_gpu_in_fp32(tiny_dist_models, compile_options, dp_ep_graphs):
    """Requests spread over the two replicas (uneven token counts per step, an idle replica's
    dummy forwards at the end), MoE tokens moved over NCCL; compiled: the MoE op stays opaque;
    graphs: both replicas replay one padded size per decode step (an idle one, padding only)."""
    from atom_core.config import EngineConfig
    from tests.distributed.engines import ThreadedEngine

    path = tiny_dist_models("qwen3_moe")
    reference = _reference(path)
    config = EngineConfig.from_kwargs(str(path), device="cuda", dtype="float32", num_kv_blocks=512,
                                      max_num_batched_tokens=256, data_parallel_size=2, enable_expert_parallel=True,
                                      num_scheduler_steps=1, **compile_options)
    assert config.use_cuda_graphs == dp_ep_graphs
    engine = ThreadedEngine(config, GREEDY, timeout_s=240)
    try:
        assert engine.run(engine.generate_all(_prompts())) == reference
    finally:
        engine.close()
