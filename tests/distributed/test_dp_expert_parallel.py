"""DP attention + EP experts (`-dp 2 --enable-expert-parallel`) on a tiny Qwen3-MoE, CPU and gloo.

Each replica runs its own requests; the experts are split over the replicas, whose engine cores
step in lock-step (an idle one runs dummy forwards). Greedy tokens must equal HF transformers'
whatever the replicas hold; a replica that skipped a forward would leave the other waiting in a
collective, so these tests time out rather than pass when the lock-step breaks.
"""
import asyncio
import os
import signal
import time

import httpx
import pytest
import torch

from atom_core import LLMEngine, SamplingParams
from atom_core.config import EngineConfig
from tests.distributed.dead_engine import assert_engine_dead
from tests.distributed.engines import ThreadedEngine
from tests.distributed.ranks import lockstep_decode_eager_then_graphs, replica_checks, run_ranks
from tests.models.harness import hf_greedy
from tests.server.conftest import start_server

MAX_TOKENS = 8
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13], [14, 15, 16, 17, 18, 19, 20]]
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
DP_EP = dict(data_parallel_size=2, enable_expert_parallel=True, num_scheduler_steps=1)
CALL_TIMEOUT_S = 60  # a broken lock-step hangs a collective: fail instead


@pytest.fixture(scope="module")
def moe_path(tiny_dist_models):
    return tiny_dist_models("qwen3_moe")


@pytest.fixture(scope="module")
def hf_tokens(moe_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(moe_path), dtype=torch.float32).eval()
    return dict(zip(map(tuple, PROMPTS), hf_greedy(model, PROMPTS, MAX_TOKENS)))


@pytest.fixture(scope="module")
def dp_ep(moe_path):
    engine = ThreadedEngine(EngineConfig.from_kwargs(str(moe_path), device="cpu", kv_cache_memory_gb=0.02, **DP_EP),
                            PARAMS, CALL_TIMEOUT_S)
    yield engine
    engine.close()


class TestLockstepServing:
    def test_concurrent_requests_spread_over_replicas_equal_hf(self, dp_ep, hf_tokens):
        before = list(dp_ep.engine.num_routed)

        outputs = dp_ep.run(dp_ep.generate_all(PROMPTS))
        assert [n - b for n, b in zip(dp_ep.engine.num_routed, before)] == [2, 2]
        assert outputs == [hf_tokens[tuple(p)] for p in PROMPTS]

    def test_one_busy_replica_while_the_other_runs_dummy_steps(self, dp_ep, hf_tokens):
        before = list(dp_ep.engine.num_routed)
        for prompt in PROMPTS[:2]:  # one at a time: the least busy replica is always replica 0
            assert dp_ep.run(dp_ep.generate(prompt)) == hf_tokens[tuple(prompt)]
        assert [n - b for n, b in zip(dp_ep.engine.num_routed, before)] == [2, 0]

    def test_requests_arriving_at_different_times_equal_hf(self, dp_ep, hf_tokens):
        """The second request prefills on replica 1 while replica 0 decodes the first."""
        before = list(dp_ep.engine.num_routed)

        async def main():
            started = asyncio.Event()
            first = asyncio.ensure_future(dp_ep.generate(PROMPTS[3], started))
            await started.wait()
            assert not first.done()  # 6 of its tokens to go
            second = await dp_ep.generate(PROMPTS[1])
            return await first, second

        assert dp_ep.run(main()) == (hf_tokens[tuple(PROMPTS[3])], hf_tokens[tuple(PROMPTS[1])])
        assert [n - b for n, b in zip(dp_ep.engine.num_routed, before)] == [1, 1]
        assert dp_ep.engine.is_healthy


def test_all_to_all_dispatch_serves_the_same_tokens(moe_path, hf_tokens):
    """ep_dispatch=alltoall (each replica's core builds its MoE layers under the config): tokens travel
    to their experts' owners only; greedy output still equals HF, with both replicas busy and one idle."""
    config = EngineConfig.from_kwargs(str(moe_path), device="cpu", kv_cache_memory_gb=0.02, ep_dispatch="alltoall",
                                      **DP_EP)
    engine = ThreadedEngine(config, PARAMS, CALL_TIMEOUT_S)
    try:
        assert engine.run(engine.generate_all(PROMPTS)) == [hf_tokens[tuple(p)] for p in PROMPTS]
        assert engine.run(engine.generate(PROMPTS[0])) == hf_tokens[tuple(PROMPTS[0])]
    finally:
        engine.close()


def test_ep_dispatch_option_values():
    from atom_core.envs import read_envs

    assert read_envs({}).ep_dispatch is None and EngineConfig.from_kwargs("m").kernel.ep_dispatch == "allgather"
    assert read_envs({"ATOM_EP_DISPATCH": "AllToAll"}).ep_dispatch == "alltoall"
    with pytest.raises(ValueError, match="invalid ATOM_EP_DISPATCH='nccl'; expected one of: allgather, alltoall"):
        read_envs({"ATOM_EP_DISPATCH": "nccl"})
    with pytest.raises(ValueError, match="invalid kernel option ep_dispatch='nccl' .--ep-dispatch.; expected one "
                                         "of: allgather, alltoall"):
        EngineConfig.from_kwargs("m", ep_dispatch="nccl")


MOE_COUNTS = [3, 5]  # replica 0 brings 3 tokens to the lone MoE layer, replica 1 brings 5


@pytest.fixture(scope="module")
def lone_moe():
    """Weights of one MoE layer (8 experts, hidden 16, intermediate 12) and each replica's tokens."""
    g = torch.Generator().manual_seed(3)
    weights = {"w13": torch.randn(8, 24, 16, generator=g) * 0.3, "w2": torch.randn(8, 16, 12, generator=g) * 0.3}
    inputs = [(torch.randn(n, 16, generator=g), torch.randn(n, 8, generator=g)) for n in MOE_COUNTS]
    return weights, inputs


@pytest.fixture(scope="module")
def replica_ranks(moe_path, lone_moe):
    """Two gloo ranks joined as replicas sharing experts: what each built and computed."""
    return run_ranks(2, replica_checks, moe_path, *lone_moe, MOE_COUNTS, replica_experts=True)


class TestExpertSplit:
    def test_each_replica_holds_a_disjoint_half_of_the_experts_as_loaded(self, moe_path, replica_ranks):
        from safetensors.torch import load_file

        ranks = [r["model"] for r in replica_ranks]
        checkpoint = {}
        for f in moe_path.glob("*.safetensors"):
            checkpoint.update(load_file(str(f)))
        assert ranks[0].keys() == ranks[1].keys() and ranks[0]  # every MoE layer, on both
        for name in ranks[0]:
            (start0, n0, *_), (start1, n1, *_) = ranks[0][name], ranks[1][name]
            assert (start0, n0, start1, n1) == (0, 4, 4, 4)  # 8 experts: [0, 4) and [4, 8)
            for start, num, w13, w2 in (ranks[0][name], ranks[1][name]):
                w13, w2 = torch.from_numpy(w13), torch.from_numpy(w2)
                assert w13.shape[0] == w2.shape[0] == num
                for local in range(num):
                    expert = f"{name}.{start + local}"  # the checkpoint's per-expert names
                    gate_up = torch.cat([checkpoint[f"{expert}.gate_proj.weight"],
                                         checkpoint[f"{expert}.up_proj.weight"]])
                    assert torch.equal(w13[local], gate_up)
                    assert torch.equal(w2[local], checkpoint[f"{expert}.down_proj.weight"])

    def test_dispatch_and_combine_equal_one_process(self, lone_moe, replica_ranks):
        """Each replica gets back what one process holding every expert computes for its own
        tokens, whether the token counts were agreed beforehand or asked for in the layer."""
        from atom_core.model_ops.moe import FusedMoE, MoERouting

        weights, inputs = lone_moe
        experts, two_inter, hidden = weights["w13"].shape
        whole = FusedMoE(experts, hidden, two_inter // 2, MoERouting(top_k=2, renormalize=True), prefix="moe")
        whole.weight_loader(whole.w13_weight, weights["w13"])
        whole.weight_loader(whole.w2_weight, weights["w2"])
        largest = max(MOE_COUNTS)
        padded = torch.cat([torch.cat([x, torch.zeros(largest - len(x), hidden)]) for x, _ in inputs])
        for r, rank in enumerate(replica_ranks):
            out = {k: torch.from_numpy(v) if k not in ("experts", "w13") else v for k, v in rank["moe"].items()}
            assert out["experts"] == (4 * r, 4) and out["w13"] == (4, two_inter, hidden)
            expected = whole(*inputs[r])
            torch.testing.assert_close(out["agreed"], expected, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(out["asked"], expected, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(out["alltoall"], expected, rtol=1e-5, atol=1e-6)  # ATOM_EP_DISPATCH=alltoall
            assert torch.equal(out["dispatched"], padded)
            torch.testing.assert_close(out["combined"], 3 * inputs[r][0])  # rank 0 sent 1x, rank 1 2x


def test_replicas_share_one_meeting_port_and_know_their_rank():
    from atom_core.engine.dp_engine import replica_config

    config = EngineConfig.from_kwargs("m", device="cuda", master_port=7000, **DP_EP)
    second = replica_config(config, 1)
    par = second.parallel
    assert (second.model.device, par.master_port, par.data_parallel_size, par.data_parallel_rank) == (
        "cuda:1", 7000, 2, 1)
    assert par.experts_span_replicas and replica_config(config, 0).parallel.data_parallel_rank == 0
    assert second.profiler.profiler_rank_dir == "dp1_tp0"


class TestRefusedAtStart:
    @pytest.mark.parametrize("options, match", [
        (dict(tensor_parallel_size=2), "tensor parallelism inside a replica is not supported"),
        (dict(num_scheduler_steps=8), "num_scheduler_steps=8.*use num_scheduler_steps=1"),
        (dict(method="ngram", num_speculative_tokens=2), "method='ngram'.*speculative decoding changes the number"),
    ], ids=["tp2", "multi_step", "speculative"])
    def test_combinations_that_change_forwards_per_step(self, options, match):
        with pytest.raises(ValueError, match=match):
            EngineConfig.from_kwargs("m", **{**DP_EP, **options})

    @pytest.mark.parametrize("options, match", [
        (dict(level=1), r"--level=1: .*run without CUDA graphs under ep_dispatch=alltoall.*use --level 2"),
        (dict(level=3), r"--level=3: .*run without CUDA graphs"),
        (dict(cudagraph_capture_sizes=[1, 2]), r"--cudagraph-capture-sizes=\(1, 2\)"),
    ], ids=["graphs_level1", "graphs_level3", "capture_sizes"])
    def test_graph_options_with_replica_graphs_off(self, options, match):
        EngineConfig.from_kwargs("m", **{**DP_EP, **options})  # accepted by default: decode graphs at an agreed size
        with pytest.raises(ValueError, match=match):
            EngineConfig.from_kwargs("m", ep_dispatch="alltoall", **{**DP_EP, **options})

    def test_default_and_compile_only_levels_are_accepted(self):
        for options in ({}, {"level": 2}, {"level": 0}):
            config = EngineConfig.from_kwargs("m", **{**DP_EP, **options})
            assert not config.use_cuda_graphs

    def test_expert_parallel_on_a_dense_model_names_the_flag(self, tiny_dist_models):
        from atom_core.distributed.checks import check_parallel
        from atom_core.loader import resolve_model, resolve_model_files

        config = EngineConfig.from_kwargs(str(tiny_dist_models("llama")), device="cpu", **DP_EP)
        model = resolve_model(config.model, resolve_model_files(config.model.model))
        with pytest.raises(ValueError, match="enable_expert_parallel needs a mixture-of-experts model"):
            check_parallel(config.parallel, model)

    def test_experts_must_split_evenly_over_the_replicas(self, moe_path):
        from atom_core.distributed.checks import check_parallel
        from atom_core.loader import resolve_model, resolve_model_files

        config = EngineConfig.from_kwargs(str(moe_path), device="cpu", **{**DP_EP, "data_parallel_size": 3})
        model = resolve_model(config.model, resolve_model_files(config.model.model))
        with pytest.raises(ValueError, match="8 experts are not divisible by data_parallel_size=3"):
            check_parallel(config.parallel, model)

    def test_llm_engine_runs_one_replica(self, moe_path):
        with pytest.raises(ValueError, match="data-parallel replicas run behind `atomctl serve`"):
            LLMEngine(str(moe_path), device="cpu", **DP_EP)

    def test_lockstep_cuda_graphs_follow_eager_and_the_dispatch(self):
        assert EngineConfig.from_kwargs("m", device="cuda", tensor_parallel_size=2).use_cuda_graphs
        assert EngineConfig.from_kwargs("m", device="cuda", **DP_EP).use_cuda_graphs
        assert not EngineConfig.from_kwargs("m", device="cuda", enforce_eager=True, **DP_EP).use_cuda_graphs
        assert not EngineConfig.from_kwargs("m", device="cuda", ep_dispatch="alltoall", **DP_EP).use_cuda_graphs


def test_served_then_a_dead_replica_fails_fast(moe_path, tmp_path):
    """`atomctl serve -dp 2 --enable-expert-parallel`: after one replica's core is killed the
    other's collectives fail too, /health reports engine_dead and requests get a 503, quickly."""
    srv = start_server(moe_path, tmp_path, "-dp", "2", "--enable-expert-parallel")
    body = {"model": srv.model_name, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}
    try:
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        cores = [int(p) for p in open(f"/proc/{srv.proc.pid}/task/{srv.proc.pid}/children").read().split()
                 if b"spawn_main" in open(f"/proc/{p}/cmdline", "rb").read()]
        assert len(cores) == 2
        os.kill(cores[0], signal.SIGKILL)
        deadline = time.monotonic() + 20
        assert_engine_dead(srv, body, deadline)
        while time.monotonic() < deadline and "another replica has died" not in srv.log():
            time.sleep(0.2)  # the survivor's collectives fail with a message naming the cause
        assert "a collective with the replicas that share its experts failed; another replica has died" in srv.log()
    finally:
        srv.stop()


class TestDecodeGraphs:
    """Replicas replay decode graphs at one size agreed each step (the default; --enforce-eager or
    ep_dispatch=alltoall turn it off)."""

    def test_graph_size_rule(self):
        from atom_core.engine.lockstep import lockstep_graph_size

        sizes = (1, 2, 4, 8)
        assert lockstep_graph_size([3, 1], [True, True], sizes) == 4  # the largest batch, padded
        assert lockstep_graph_size([0, 2], [True, True], sizes) == 2  # an idle replica replays padding
        assert lockstep_graph_size([3, 1], [True, False], sizes) is None  # one prefills: all eager
        assert lockstep_graph_size([0, 0], [True, True], sizes) is None
        assert lockstep_graph_size([9, 1], [True, True], sizes) is None  # past the largest graph
        assert lockstep_graph_size([3, 1], [True, True], ()) is None  # no graphs captured

    def test_options(self, monkeypatch):
        cuda = dict(device="cuda", **DP_EP)
        monkeypatch.delenv("ATOM_EP_DISPATCH", raising=False)
        assert EngineConfig.from_kwargs("m", **cuda).use_cuda_graphs  # the default: graphs with the all-gather
        assert EngineConfig.from_kwargs("m", level=1, cudagraph_capture_sizes=[1, 2], **cuda).use_cuda_graphs
        assert not EngineConfig.from_kwargs("m", level=2, **cuda).use_cuda_graphs
        with pytest.raises(ValueError, match="replay full decode graphs only"):
            EngineConfig.from_kwargs("m", cudagraph_mode="full_and_piecewise", **cuda)
        assert not EngineConfig.from_kwargs("m", enforce_eager=True, **cuda).use_cuda_graphs
        assert not EngineConfig.from_kwargs("m", ep_dispatch="alltoall", **cuda).use_cuda_graphs  # off unless asked
        with pytest.raises(ValueError, match=r"without CUDA graphs under ep_dispatch=alltoall \(--ep-dispatch"):
            EngineConfig.from_kwargs("m", level=3, ep_dispatch="alltoall", **cuda)
        assert not EngineConfig.from_kwargs("m", level=2, ep_dispatch="alltoall", **cuda).use_cuda_graphs
        monkeypatch.setenv("ATOM_EP_DISPATCH", "alltoall")  # the environment as the option's default
        assert not EngineConfig.from_kwargs("m", **cuda).use_cuda_graphs
        assert EngineConfig.from_kwargs("m", ep_dispatch="allgather", **cuda).use_cuda_graphs  # the option wins

    def test_replicas_replaying_at_the_agreed_size_equal_eager_and_hf(self, moe_path, hf_tokens, monkeypatch):
        """Replica 0 decodes 3 requests (graph of 4: one padding row), replica 1 one request that
        ends early (then it replays padding only while replica 0 goes on): tokens equal the eager
        lock-step run's and HF's."""
        prompts = [PROMPTS[:3], PROMPTS[3:]]
        max_tokens = [MAX_TOKENS, 3]
        by_rank = run_ranks(2, lockstep_decode_eager_then_graphs, str(moe_path), prompts, max_tokens,
                            replica_experts=True, timeout=2 * CALL_TIMEOUT_S)
        eager, graphs = [r[0] for r in by_rank], [r[1] for r in by_rank]
        for rank in (0, 1):
            want = [hf_tokens[tuple(p)][: max_tokens[rank]] for p in prompts[rank]]
            assert eager[rank]["tokens"] == want and graphs[rank]["tokens"] == want, rank
            assert not eager[rank]["graphs"] and graphs[rank]["graphs"]
        replays0, replays1 = graphs[0]["replay"], graphs[1]["replay"]
        assert (3, 4) in replays0 and all(size is not None for _, size in replays0 + replays1)
        assert (1, 4) in replays1  # replica 1's one request padded to replica 0's size
        assert graphs[1]["padding"] and set(graphs[1]["padding"]) <= {2, 4}  # idle: padding rows only
        assert graphs[0]["eager_dummy"] == graphs[1]["eager_dummy"] == 0
