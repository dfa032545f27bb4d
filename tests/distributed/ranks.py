"""Helpers that run in spawned rank processes (importable by module name, as spawn needs)."""
from __future__ import annotations

import socket
import traceback

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn, args, results, replica_experts: bool, device_type: str,
           all_reduce: str) -> None:
    from atom_core.distributed import destroy_distributed, init_distributed, init_replica_experts

    try:
        torch.set_num_threads(1)
        device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if replica_experts:
            init_replica_experts(rank, world_size, f"tcp://127.0.0.1:{port}", device, timeout_s=60)
        else:
            init_distributed(rank, world_size, f"tcp://127.0.0.1:{port}", device, timeout_s=60, all_reduce=all_reduce)
        results.put((rank, True, fn(*args)))
    except BaseException:  # noqa: BLE001 - reported to the test process
        results.put((rank, False, traceback.format_exc()))
    finally:
        destroy_distributed()


def run_ranks(world_size: int, fn, *args, timeout: float = 120.0, replica_experts: bool = False,
              device_type: str = "cpu", all_reduce: str = "auto") -> list:
    """fn(*args) on each of `world_size` ranks (one spawned process each); results by rank.
    replica_experts: the ranks are data-parallel replicas sharing experts (init_replica_experts),
    not one tensor-parallel group. device_type "cuda": rank r on cuda:r over NCCL (else gloo).
    all_reduce: the tensor-parallel group's all-reduce mode (KernelConfig.all_reduce)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, results, replica_experts, device_type,
                                              all_reduce), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in procs:
            rank, ok, value = results.get(timeout=timeout)
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world_size)]


def tp_greedy(path, prompts, max_tokens: int, expert_parallel: bool = False, chunk: int | None = None):
    """This rank's greedy tokens from the model at `path`, built under the current TP group."""
    from transformers import AutoConfig

    from atom_core.distributed import set_expert_parallel
    from atom_core.loader import build_model
    from tests.models.harness import greedy_generate

    set_expert_parallel(expert_parallel)
    model = build_model(AutoConfig.from_pretrained(str(path)), path, torch.float32, "cpu")
    return greedy_generate(model, prompts, max_tokens, chunk=chunk)


def tp_greedy_jobs(jobs: list[tuple]) -> list:
    """tp_greedy(*job) for every job, in one rank process (spawning costs more than the models)."""
    return [tp_greedy(*job) for job in jobs]


def share_host_checks(host_lists: list[list[str] | None]) -> list[bool]:
    """ranks_share_a_host on the TP group's host-side group once per entry, this rank naming itself
    hosts[rank] (None: its real host name); in one rank process (spawning costs more than the checks)."""
    from atom_core.distributed import get_tp_group
    from atom_core.distributed.symm_all_reduce import ranks_share_a_host

    group = get_tp_group()
    return [ranks_share_a_host(group.cpu_group, None if hosts is None else hosts[group.rank_in_group])
            for hosts in host_lists]


def collectives_check() -> dict:
    """Every collective against its definition, on this rank's values."""
    from atom_core.distributed import all_gather, all_reduce, all_to_all, get_tp_group, reduce_scatter
    from atom_core.distributed.communication import MessageBroadcaster, all_reduce_min_host

    group = get_tp_group()
    r, w = group.rank_in_group, group.world_size
    x = torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * r
    out = {
        "all_reduce": all_reduce(x).tolist(),
        "all_gather_0": all_gather(x, dim=0).tolist(),
        "all_gather_1": all_gather(x, dim=-1).tolist(),
        "reduce_scatter": reduce_scatter(torch.arange(4 * w, dtype=torch.float32).view(2 * w, 2) + r, dim=0).tolist(),
        "all_to_all": all_to_all(torch.arange(w, dtype=torch.float32) + 100 * r).tolist(),
        "min": all_reduce_min_host(5 + r),
    }
    b = MessageBroadcaster(group, capacity=64)
    out["small"] = b.broadcast({"step": 1} if r == 0 else None)
    out["large"] = b.broadcast(list(range(500)) if r == 0 else None)  # past the 64-byte buffer
    out["compiled"] = torch.compile(lambda t: all_reduce(t * 2) + 1, fullgraph=True)(x).tolist()
    return out


def replica_moe_check(weights: dict, inputs: list, counts_seen: list) -> dict:
    """One FusedMoE split over the replicas (whole experts each) fed this replica's own tokens:
    its output with the counts agreed beforehand and with the counts asked for, plus the raw
    dispatch and combine of this replica's rows."""
    from atom_core.distributed import agreed_token_counts, combine_tokens, dispatch_tokens, get_ep_group
    from atom_core.model_ops.moe import FusedMoE, MoERouting

    group = get_ep_group()
    r = group.rank_in_group
    num_experts, two_inter, hidden = weights["w13"].shape
    from atom_core.kernel_config import KernelConfig, building

    def build() -> FusedMoE:
        layer = FusedMoE(num_experts, hidden, two_inter // 2, MoERouting(top_k=2, renormalize=True), prefix="moe")
        layer.weight_loader(layer.w13_weight, weights["w13"])  # the whole checkpoint tensor: this rank's experts kept
        layer.weight_loader(layer.w2_weight, weights["w2"])
        return layer

    layer = build()
    with building(KernelConfig(ep_dispatch="alltoall")):
        by_owner = build()
    assert not layer.all_to_all and by_owner.all_to_all
    x, logits = inputs[r]
    with agreed_token_counts(counts_seen):
        agreed = layer(x, logits)
    dispatched = dispatch_tokens(x, counts_seen, group)
    by_all_to_all = by_owner(x, logits)
    out = {"agreed": agreed, "asked": layer(x, logits), "alltoall": by_all_to_all, "dispatched": dispatched,
           "combined": combine_tokens(dispatched * (r + 1), counts_seen, group)}
    # numpy: a tensor crosses the result queue as a shared-memory handle, gone once this rank exits
    return {"experts": (layer.expert_start, layer.num_local_experts), "w13": tuple(layer.w13_weight.shape),
            **{k: v.detach().numpy() for k, v in out.items()}}


def replica_model_experts(path) -> dict:
    """The tiny MoE model at `path` built as one replica sharing experts: per MoE layer, this
    replica's expert range and its stacked weights (as loaded)."""
    from transformers import AutoConfig

    from atom_core.loader import build_model
    from atom_core.model_ops.moe import FusedMoE

    model = build_model(AutoConfig.from_pretrained(str(path)), path, torch.float32, "cpu")
    return {name: (m.expert_start, m.num_local_experts, m.w13_weight.detach().numpy(), m.w2_weight.detach().numpy())
            for name, m in model.named_modules() if isinstance(m, FusedMoE)}


def replica_checks(path, weights: dict, inputs: list, counts: list) -> dict:
    """replica_model_experts and replica_moe_check in one rank process (spawning costs more)."""
    return {"model": replica_model_experts(path), "moe": replica_moe_check(weights, inputs, counts)}


def symm_all_reduce_check(shapes: list[tuple[int, int]], max_bytes: int) -> dict:
    """On CUDA ranks under ATOM_ALL_REDUCE=symm: all_reduce of the same inputs on every rank against
    their float32 sum, eagerly and replayed in a CUDA graph, and which sizes took the symmetric path."""
    from atom_core.distributed import all_reduce, get_tp_group
    from atom_core.distributed.parallel_state import get_symmetric_all_reduce

    group = get_tp_group()
    device = torch.device("cuda", torch.cuda.current_device())
    symm = get_symmetric_all_reduce("tp")
    errors = []
    for d, dtype in enumerate((torch.bfloat16, torch.float32)):
        for s, shape in enumerate(shapes):
            g = torch.Generator(device=device).manual_seed(100 * d + s)  # the same inputs on every rank
            xs = [torch.randn(shape, generator=g, device=device).to(dtype) for _ in range(group.world_size)]
            want = sum(x.float() for x in xs).to(dtype)
            x = xs[group.rank_in_group].clone()
            eager = all_reduce(x)
            static_in = torch.zeros_like(x)
            graph = torch.cuda.CUDAGraph()
            all_reduce(static_in)  # warm-up outside capture
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                static_out = all_reduce(static_in)
            for _ in range(2):
                static_in.copy_(x)
                graph.replay()
            torch.cuda.synchronize()
            for name, got in (("eager", eager), ("graph", static_out)):
                if not torch.allclose(got.float(), want.float(), atol=1e-2 if dtype == torch.bfloat16 else 1e-5):
                    errors.append(f"{name} {shape} {dtype}: max err {(got.float() - want.float()).abs().max()}")
            used = symm is not None and symm.fits(x)
            nbytes = x.numel() * x.element_size()
            if used != (nbytes <= max_bytes and nbytes % 4 == 0):  # (1, 8193) bf16: an odd size goes to NCCL
                errors.append(f"{shape} {dtype}: symmetric path used={used}")
    return {"has_symm": symm is not None, "errors": errors}


def lockstep_decode(path: str, prompts_by_rank: list, max_tokens_by_rank: list[int], graphs: bool,
                    steps: int = 30) -> dict:
    """One lock-step replica (this rank of a replica_experts world) running its own prompts greedily
    for a fixed number of steps (every replica the same number, as the core loop does). graphs:
    decode 'replays' CUDAGraphRunner's graphs with eager stand-ins run under the counts lock-step
    agreed (the capture is GPU-only; padding to the agreed size, idle replicas' padding replays and
    the MoE all-gathers at that size run for real). Returns the tokens per prompt and the paths taken."""
    from atom_core import SamplingParams
    from atom_core.config import EngineConfig
    from atom_core.distributed import get_ep_group
    from atom_core.engine import lockstep
    from atom_core.model_ops.forward_context import set_attention_metadata
    from atom_core.worker.cuda_graph import CUDAGraphRunner

    calls = {"replay": [], "padding": [], "eager_dummy": 0}

    class EagerGraph:
        def __init__(self, runner, bs):
            self.runner, self.bs = runner, bs

        def replay(self):  # under the step's agreed counts: a wrong agreement fails the MoE's check
            r, tokens = self.runner, self.bs
            with set_attention_metadata(r._metadata(self.bs)):
                r.outputs[self.bs] = r.forward(r.input_ids[:tokens], r.positions[:tokens])

    def capture_eagerly(runner):
        runner.graphs = {bs: EagerGraph(runner, bs) for bs in runner.sizes}

    group = get_ep_group()
    real_replay, real_padding = CUDAGraphRunner.replay, CUDAGraphRunner.replay_padding
    if graphs:
        EngineConfig.use_cuda_graphs = property(lambda self: True)  # this spawned process only
        CUDAGraphRunner.capture_all = capture_eagerly
        CUDAGraphRunner.replay = lambda self, flat, inputs_only=False, size=None: (
            calls["replay"].append((flat.num_tokens, size)) or real_replay(self, flat, inputs_only, size))
        CUDAGraphRunner.replay_padding = lambda self, size: calls["padding"].append(size) or real_padding(self, size)
    lockstep.init_replica_experts = lambda *args, **kwargs: group  # this world is already joined
    lockstep.destroy_distributed = lambda: None  # the rank harness leaves it
    config = EngineConfig.from_kwargs(path, device="cpu", dtype="float32", num_kv_blocks=64, data_parallel_size=2,
                                      enable_expert_parallel=True, num_scheduler_steps=1, max_num_seqs=4,
                                      data_parallel_rank=group.rank_in_group, master_port=1,
                                      cudagraph_capture_sizes=(1, 2, 4) if graphs else None)
    core = lockstep.LockstepEngineCore(config)
    runner = core.executor.runner
    real_dummy = runner.run_dummy_forward

    def dummy():
        from atom_core.distributed import agreed_graph_size

        calls["eager_dummy"] += agreed_graph_size() is None
        real_dummy()

    runner.run_dummy_forward = dummy
    prompts = prompts_by_rank[group.rank_in_group]
    params = SamplingParams(temperature=0, max_tokens=max_tokens_by_rank[group.rank_in_group], ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(f"r{i}", prompt, params)
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    for _ in range(steps):
        for o in core.step():
            tokens[o.request_id] += o.new_token_ids
    captured = runner.dispatcher.full is not None
    core.shutdown()
    assert runner.dispatcher.full is None  # released before the group's teardown
    return {"tokens": [tokens[f"r{i}"] for i in range(len(prompts))], "graphs": captured, **calls}


def lockstep_decode_eager_then_graphs(path: str, prompts_by_rank: list, max_tokens_by_rank: list[int]) -> tuple:
    """lockstep_decode eagerly, then with graphs (which patches classes of this process for good), one
    engine core after the other in one rank process (spawning costs more than the cores)."""
    eager = lockstep_decode(path, prompts_by_rank, max_tokens_by_rank, False)
    return eager, lockstep_decode(path, prompts_by_rank, max_tokens_by_rank, True)
