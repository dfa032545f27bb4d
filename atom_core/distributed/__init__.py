"""Tensor / expert parallelism over torch.distributed (NCCL on GPUs, gloo on CPUs)."""
from atom_core.distributed.communication import all_gather, all_reduce, all_to_all, reduce_scatter
from atom_core.distributed.parallel_state import (GroupCoordinator, destroy_distributed, expert_parallel_enabled,
                                                  get_ep_group, get_tp_group, get_tp_rank, get_tp_size,
                                                  init_distributed, set_expert_parallel)

__all__ = ["GroupCoordinator", "all_gather", "all_reduce", "all_to_all", "destroy_distributed", "expert_parallel_enabled", "get_ep_group",
           "get_tp_group", "get_tp_rank", "get_tp_size", "init_distributed", "reduce_scatter", "set_expert_parallel"]
