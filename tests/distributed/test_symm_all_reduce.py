"""ATOM_ALL_REDUCE: NCCL or PyTorch symmetric-memory all-reduce for tensor parallelism.
CPU: the option's parsing and errors, and auto falling back to the process group's all-reduce
on gloo ranks. Two GPUs: the sum (one-shot up to 256 KiB, two-shot above) equals the definition eagerly and replayed in a CUDA
graph, over the sizes decode uses, with the larger ones left to NCCL."""
import pytest
import torch

from atom_core.distributed.symm_all_reduce import MAX_BYTES, make_symmetric_all_reduce
from atom_core.envs import read_envs
from tests.distributed.ranks import collectives_check, free_port, run_ranks


def test_option_values_and_default():
    assert read_envs({}).all_reduce == "nccl"
    for mode in ("nccl", "symm", "auto"):
        assert read_envs({"ATOM_ALL_REDUCE": mode.upper()}).all_reduce == mode
    with pytest.raises(ValueError, match="ATOM_ALL_REDUCE"):
        read_envs({"ATOM_ALL_REDUCE": "mpi"})


def test_symm_on_cpu_ranks_is_a_clear_error_and_auto_or_nccl_use_the_group():
    with pytest.raises(ValueError, match="ATOM_ALL_REDUCE=symm needs CUDA"):
        make_symmetric_all_reduce("symm", None, torch.device("cpu"))
    assert make_symmetric_all_reduce("auto", None, torch.device("cpu")) is None
    assert make_symmetric_all_reduce("nccl", None, torch.device("cuda", 0)) is None


def test_auto_on_gloo_ranks_keeps_the_collectives_right(monkeypatch):
    monkeypatch.setenv("ATOM_ALL_REDUCE", "auto")  # spawned ranks inherit it
    r0, r1 = run_ranks(2, collectives_check)
    x0 = torch.arange(6.0).view(2, 3)
    assert r0["all_reduce"] == r1["all_reduce"] == (2 * x0 + 10).tolist()
    assert r0["compiled"] == (2 * (2 * x0 + 10) + 1).tolist()


def test_symm_on_gloo_ranks_fails_at_join(monkeypatch):
    monkeypatch.setenv("ATOM_ALL_REDUCE", "symm")
    with pytest.raises(AssertionError, match="ATOM_ALL_REDUCE=symm needs CUDA"):
        run_ranks(2, collectives_check)


# ---- two GPUs -------------------------------------------------------------------------------

SHAPES = [(1, 4096), (3, 4096), (64, 8192), (1, 8193), (1024, 8192)]  # 1024 x 8192 bf16 = MAX_BYTES


def _gpu_rank(rank: int, world: int, port: int, results) -> None:
    import torch.distributed as dist

    from atom_core.distributed import destroy_distributed, init_distributed
    from atom_core.distributed.communication import all_reduce

    try:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        init_distributed(rank, world, f"tcp://127.0.0.1:{port}", device, timeout_s=120)
        from atom_core.distributed.parallel_state import get_symmetric_all_reduce

        symm = get_symmetric_all_reduce("tp")
        errors = []
        for d, dtype in enumerate((torch.bfloat16, torch.float32)):
            for s, shape in enumerate(SHAPES + [(1100, 8192)]):  # the last is past MAX_BYTES: NCCL
                g = torch.Generator(device=device).manual_seed(100 * d + s)  # the same inputs on every rank
                xs = [torch.randn(shape, generator=g, device=device).to(dtype) for _ in range(world)]
                want = sum(x.float() for x in xs).to(dtype)
                x = xs[rank].clone()
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
                if used != (nbytes <= MAX_BYTES and nbytes % 4 == 0):  # (1, 8193) bf16: an odd size goes to NCCL
                    errors.append(f"{shape} {dtype}: symmetric path used={used}")
        dist.barrier()
        results.put((rank, symm is not None, errors))
    except BaseException:  # noqa: BLE001 - reported to the test process
        import traceback

        results.put((rank, None, traceback.format_exc()))
    finally:
        destroy_distributed()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_shot_all_reduce_on_two_gpus(monkeypatch):
    import torch.multiprocessing as mp

    monkeypatch.setenv("ATOM_ALL_REDUCE", "symm")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_gpu_rank, args=(r, 2, port, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            rank, has_symm, errors = results.get(timeout=240)
            assert has_symm is not None, f"rank {rank} failed:\n{errors}"
            assert has_symm, f"rank {rank}: ATOM_ALL_REDUCE=symm built no symmetric all-reduce"
            assert not errors, f"rank {rank}: {errors}"
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
