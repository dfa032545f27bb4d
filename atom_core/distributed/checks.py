"""Parallel settings against the model and the machine, checked before any rank starts."""
from __future__ import annotations

import torch

from atom_core.config import ParallelConfig, ResolvedModel

_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
_MOE_INTER_FIELDS = ("moe_intermediate_size", "intermediate_size")


def check_head_split(num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    """Query heads split evenly; kv heads split evenly, or each is replicated on tp/kv ranks."""
    if num_heads % tp_size:
        raise ValueError(f"num_attention_heads={num_heads} is not divisible by tensor_parallel_size={tp_size}")
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise ValueError(f"num_key_value_heads={num_kv_heads} and tensor_parallel_size={tp_size}: one must divide "
                         "the other (kv heads split evenly, or each is replicated on tp/kv ranks)")


def num_experts_of(hf_config) -> int:
    return next((int(getattr(hf_config, f)) for f in _EXPERT_FIELDS if getattr(hf_config, f, None)), 0)


def check_parallel(par: ParallelConfig, model: ResolvedModel) -> None:
    """ValueError naming the setting when the model cannot split as asked, or the node lacks
    the GPUs for its ranks."""
    tp, hf = par.tensor_parallel_size, model.hf_config
    if tp > 1:
        heads = hf.num_attention_heads
        check_head_split(heads, getattr(hf, "num_key_value_heads", None) or heads, tp)
        dense = getattr(hf, "intermediate_size", None)
        if dense and dense % tp:
            raise ValueError(f"intermediate_size={dense} is not divisible by tensor_parallel_size={tp}")
    num_experts = num_experts_of(hf)
    if par.enable_expert_parallel:
        if not num_experts:
            raise ValueError(f"enable_expert_parallel needs a mixture-of-experts model; {model.architecture} has no experts")
        ranks, name = ((par.data_parallel_size, "data_parallel_size") if par.experts_span_replicas
                       else (tp, "tensor_parallel_size"))
        if num_experts % ranks:
            raise ValueError(f"{num_experts} experts are not divisible by {name}={ranks} "
                             "(expert parallelism gives each rank whole experts)")
    elif num_experts and tp > 1:
        inter = next((getattr(hf, f) for f in _MOE_INTER_FIELDS if getattr(hf, f, None)), None)
        if inter and inter % tp:
            raise ValueError(f"the experts' intermediate size {inter} is not divisible by tensor_parallel_size={tp}; "
                             "try enable_expert_parallel")
    if model.device.type == "cuda":
        first = model.device.index or 0  # a data-parallel replica starts past the ones before it
        replicas_from_here = par.data_parallel_size - (par.data_parallel_rank or 0)
        needed = first + par.ranks_per_node * replicas_from_here
        have = torch.cuda.device_count()
        if needed > have:
            raise ValueError(f"tensor_parallel_size={tp} x data_parallel_size={par.data_parallel_size} over "
                             f"{par.nnodes} node(s) from cuda:{first} needs {needed} GPUs on this node; it has {have}")
