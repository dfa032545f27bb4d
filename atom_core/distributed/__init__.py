"""Tensor / expert parallelism over torch.distributed (NCCL on GPUs, gloo on CPUs)."""
from atom_core.distributed.communication import (agreed_graph_size, agreed_token_counts, all_gather, all_reduce, all_to_all,
                                                 combine_tokens, dispatch_tokens, reduce_scatter,
                                                 replica_token_counts)
from atom_core.distributed.parallel_state import (GroupCoordinator, adopt_tp_group, destroy_distributed,
                                                  expert_parallel_enabled, experts_span_replicas, get_ep_group, get_tp_group, get_tp_rank,
                                                  get_tp_size, init_distributed, init_replica_experts,
                                                  set_expert_parallel)

__all__ = ["GroupCoordinator", "adopt_tp_group", "agreed_graph_size", "agreed_token_counts", "all_gather", "all_reduce",
           "all_to_all", "combine_tokens",
           "destroy_distributed", "dispatch_tokens", "expert_parallel_enabled", "experts_span_replicas",
           "get_ep_group", "get_tp_group", "get_tp_rank", "get_tp_size", "init_distributed", "init_replica_experts",
           "reduce_scatter", "replica_token_counts", "set_expert_parallel"]
