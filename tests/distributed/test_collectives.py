"""The collectives over two gloo ranks, against their definitions; identities at world size 1."""
import torch

from atom_core.distributed import all_gather, all_reduce, all_to_all, get_tp_group, reduce_scatter
from tests.distributed.ranks import collectives_check, run_ranks


def test_collectives_are_identities_at_world_size_one():
    x = torch.randn(3, 4)
    assert get_tp_group().world_size == 1
    for fn in (all_reduce, all_gather, reduce_scatter, all_to_all):
        assert fn(x) is x


def test_collectives_over_two_ranks():
    # all_reduce=auto (the default) on gloo ranks: the process group's all-reduce, eagerly and compiled
    r0, r1 = run_ranks(2, collectives_check, all_reduce="auto")
    x0 = torch.arange(6.0).view(2, 3)
    x1 = x0 + 10
    for out in (r0, r1):
        assert out["all_reduce"] == (x0 + x1).tolist()
        assert out["all_gather_0"] == torch.cat([x0, x1], 0).tolist()
        assert out["all_gather_1"] == torch.cat([x0, x1], 1).tolist()
        assert out["min"] == 5
        assert out["small"] == {"step": 1}
        assert out["large"] == list(range(500))
        assert out["compiled"] == (2 * (x0 + x1) + 1).tolist()
    full = torch.arange(8.0).view(4, 2) * 2 + 1  # rank 0 adds 0, rank 1 adds 1
    assert r0["reduce_scatter"] == full[:2].tolist() and r1["reduce_scatter"] == full[2:].tolist()
    assert r0["all_to_all"] == [0.0, 100.0] and r1["all_to_all"] == [1.0, 101.0]
