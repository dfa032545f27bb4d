"""ATOM_ALL_REDUCE: NCCL or PyTorch symmetric-memory all-reduce for tensor parallelism.
CPU: the option's parsing and errors (auto falling back to the process group's all-reduce on gloo
ranks: test_collectives.py). Two GPUs (ranks.symm_all_reduce_check): the sum (one-shot up to 256 KiB,
two-shot above) equals the definition eagerly and replayed in a CUDA graph, over the sizes decode
uses, with the larger ones left to NCCL."""
import pytest
import torch

from atom_core.distributed import symm_all_reduce
from atom_core.distributed.symm_all_reduce import MAX_BYTES, make_symmetric_all_reduce
from atom_core.envs import read_envs
from atom_core.kernel_config import KernelConfig
from tests.distributed.ranks import collectives_check, run_ranks, share_host_checks, symm_all_reduce_check


def test_option_values_and_default():
    assert read_envs({}).all_reduce is None and KernelConfig().all_reduce == "auto"
    for mode in ("nccl", "symm", "auto"):
        assert read_envs({"ATOM_ALL_REDUCE": mode.upper()}).all_reduce == mode
    with pytest.raises(ValueError, match="ATOM_ALL_REDUCE"):
        read_envs({"ATOM_ALL_REDUCE": "mpi"})


def test_symm_on_cpu_ranks_is_a_clear_error_and_auto_or_nccl_use_the_group():
    with pytest.raises(ValueError, match=r"all_reduce=symm \(--all-reduce, ATOM_ALL_REDUCE\) needs CUDA"):
        make_symmetric_all_reduce("symm", None, torch.device("cpu"))
    assert make_symmetric_all_reduce("auto", None, torch.device("cpu")) is None
    assert make_symmetric_all_reduce("nccl", None, torch.device("cuda", 0)) is None


def test_ranks_share_a_host_agrees_on_every_rank():
    # this machine's name on both, then names given: one host, two hosts
    by_rank = run_ranks(2, share_host_checks, [None, ["node-a", "node-a"], ["node-a", "node-b"]])
    assert by_rank == [[True, True, False]] * 2


def test_a_group_across_hosts_keeps_nccl_under_auto_and_refuses_symm(monkeypatch):
    monkeypatch.setattr(symm_all_reduce, "ranks_share_a_host", lambda cpu_group: False)
    cuda = torch.device("cuda", 0)  # never touched: the host check comes first
    assert make_symmetric_all_reduce("auto", None, cuda, cpu_group=object()) is None
    with pytest.raises(ValueError, match="needs every tensor-parallel rank on one host"):
        make_symmetric_all_reduce("symm", None, cuda, cpu_group=object())


# auto on gloo ranks keeps the collectives right: test_collectives.py::test_collectives_over_two_ranks
# (its ranks run all_reduce=auto, eagerly and compiled).


def test_symm_on_gloo_ranks_fails_at_join():
    with pytest.raises(AssertionError, match=r"all_reduce=symm \(--all-reduce, ATOM_ALL_REDUCE\) needs CUDA"):
        run_ranks(2, collectives_check, all_reduce="symm")


# ---- two GPUs -------------------------------------------------------------------------------

SHAPES = [(1, 4096), (3, 4096), (64, 8192), (1, 8193), (1024, 8192)]  # 1024 x 8192 bf16 = MAX_BYTES


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_shot_all_reduce_on_two_gpus():
    shapes = SHAPES + [(1100, 8192)]  # the last is past MAX_BYTES: NCCL
    for rank, result in enumerate(run_ranks(2, symm_all_reduce_check, shapes, MAX_BYTES, timeout=240,
                                            device_type="cuda", all_reduce="symm")):
        assert result["has_symm"], f"rank {rank}: all_reduce=symm built no symmetric all-reduce"
        assert not result["errors"], f"rank {rank}: {result['errors']}"
