"""All-reduce on 2+ GPUs at the sizes tensor parallelism runs (issue 18): NCCL, which the engine
uses inside its CUDA graphs, against PyTorch's symmetric-memory one-shot and two-shot all-reduce
(peer-to-peer loads and stores; no NVLink multicast, which the device machines keep off), each
captured in a CUDA graph and replayed, as a decode step would. Median microseconds of a replay.
`symm_engine` is the engine's own path (distributed/symm_all_reduce.py: the input copied into the
buffer, two-shot written to a new tensor), the others the bare ops on a buffer already filled.

  python -m benchmarks.kernels.bench_allreduce --gpus 2 --hidden 4096,8192 --tokens 1,8,32,64,128,256,1024,8192

A method that cannot run here (symmetric memory not supported by this build or machine) prints
its error instead of a time. Not a test: it only measures.
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPLAYS = 50


def _time_graph(fn, reps: int = 5) -> float:
    """Median us per call of fn captured REPLAYS times in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPLAYS):
            fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / REPLAYS)
    return statistics.median(times)


def _methods(numel_max: int, device: torch.device):
    """name -> (setup(x) -> fn) for each all-reduce; setup raises where a method cannot run."""
    group_name = dist.group.WORLD.group_name

    def nccl(x):
        return lambda: dist.all_reduce(x)

    def symm(kind: str):
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(numel_max, dtype=torch.bfloat16, device=device)
        symm_mem.rendezvous(buf, dist.group.WORLD)

        def setup(x):
            view = buf[: x.numel()].view_as(x)
            view.copy_(x)
            if kind == "one_shot":
                return lambda: torch.ops.symm_mem.one_shot_all_reduce(view, "sum", group_name)
            return lambda: torch.ops.symm_mem.two_shot_all_reduce_(view, "sum", group_name)
        return setup

    def engine_path():
        """What the engine runs under ATOM_ALL_REDUCE=symm: copy-in, two-shot written to a new tensor."""
        from atom_core.distributed.symm_all_reduce import SymmetricAllReduce

        symm_ar = SymmetricAllReduce(dist.group.WORLD, device, max_bytes=numel_max * 2)

        def setup(x):
            return lambda: symm_ar(x)
        return setup

    return {"nccl": lambda: nccl, "symm_one_shot": lambda: symm("one_shot"), "symm_two_shot": lambda: symm("two_shot"),
            "symm_engine": engine_path}


def _worker(rank: int, world: int, port: int, hidden: list[int], tokens: list[int], results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    dist.all_reduce(torch.ones(1, device=device))  # the communicator exists before any capture
    numel_max = max(hidden) * max(tokens)
    rows = []
    for name, make in _methods(numel_max, device).items():
        try:
            setup = make()
        except Exception as e:  # noqa: BLE001 - report why a method cannot run here
            rows.append((name, None, None, f"{type(e).__name__}: {e}"[:120]))
            continue
        for h in hidden:
            for t in tokens:
                x = torch.randn(t, h, dtype=torch.bfloat16, device=device)
                try:
                    rows.append((name, h, t, _time_graph(setup(x))))
                except Exception as e:  # noqa: BLE001
                    rows.append((name, h, t, f"{type(e).__name__}: {e}"[:120]))
    if rank == 0:
        results.extend(rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--hidden", default="4096,8192", help="row widths (Llama-3-8B 4096, Llama-3.1-70B 8192)")
    ap.add_argument("--tokens", default="1,8,32,64,128,256,1024,8192", help="rows per all-reduce")
    ap.add_argument("--port", type=int, default=29731)
    args = ap.parse_args()
    if torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"bench_allreduce needs {args.gpus} GPUs, found {torch.cuda.device_count()}")
    hidden = [int(v) for v in args.hidden.split(",")]
    tokens = [int(v) for v in args.tokens.split(",")]
    with mp.Manager() as manager:
        results = manager.list()
        mp.spawn(_worker, args=(args.gpus, args.port, hidden, tokens, results), nprocs=args.gpus)
        rows = list(results)
    print(f"{torch.cuda.get_device_name()} x {args.gpus}: bf16 all-reduce, median us per call in a CUDA graph")
    print(f"{'method':>14} {'hidden':>7} {'tokens':>7} {'us':>9} {'GB/s bus':>9}")
    for name, h, t, us in rows:
        if not isinstance(us, float):
            print(f"{name:>14} {h or '':>7} {t or '':>7}  {us}")
            continue
        bus = 2 * (args.gpus - 1) / args.gpus * h * t * 2 / (us * 1e-6) / 1e9
        print(f"{name:>14} {h:>7} {t:>7} {us:>9.1f} {bus:>9.1f}")


if __name__ == "__main__":
    main()
