"""GPU memory sizing: what is left for KV blocks after weights, activations and graphs.

budget = total * gpu_memory_utilization - (memory other processes hold) - weights
         - peak activations of a max-size step (measured with a dummy step) - graph reserve.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from atom_core.distributed.communication import all_reduce_min_host
from atom_core.model_ops.kv_spec import kv_bytes_per_block
from atom_core.sampling_params import SamplingParams
from atom_core.scheduler_output import NewRequest, SchedulerOutput

if TYPE_CHECKING:
    from atom_core.config import EngineConfig

logger = logging.getLogger(__name__)

GRAPH_RESERVE_BYTES = 512 << 20  # decode graphs' own pool: small, outputs and attention scratch


@dataclass(frozen=True)
class MemoryPlan:
    total: int
    utilization: float
    used_by_others: int
    weights: int
    peak_activations: int
    graph_reserve: int

    @property
    def kv_budget(self) -> int:
        return int(self.total * self.utilization) - self.used_by_others - self.weights - self.peak_activations - self.graph_reserve


def num_kv_blocks(config: "EngineConfig", layers: list, max_model_len: int, device: torch.device,
                  run_peak_step: Callable[[], int]) -> int:
    """KV blocks for `layers` (the target's and a proposer's, sharing block ids): the configured
    count, else what the memory budget holds (on a GPU: profiled with `run_peak_step`, see
    profile_kv_budget), at most what max_num_seqs full-length sequences use and the same on every
    tensor-parallel rank. ValueError when one max_model_len sequence does not fit."""
    cache, sched = config.cache, config.scheduler
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    block_size = cache.block_size
    per_block = kv_bytes_per_block(layers, block_size)
    if device.type == "cuda":
        reserve = GRAPH_RESERVE_BYTES if config.use_cuda_graphs else 0
        budget = profile_kv_budget(run_peak_step, cache.gpu_memory_utilization, reserve)
    else:
        budget = int(cache.kv_cache_memory_gb * (1 << 30))
    # More blocks than max_num_seqs full-length sequences can use only serve the prefix cache.
    useful = sched.max_num_seqs * ((max_model_len + block_size - 1) // block_size)
    num = all_reduce_min_host(min(budget // per_block, useful))  # tensor parallel: what every rank fits
    needed = (max_model_len + block_size - 1) // block_size
    if num < needed:
        raise ValueError(
            f"KV cache too small: {num} blocks of {block_size} tokens cannot hold one "
            f"{max_model_len}-token sequence; {_kv_way_out(config, device, max_model_len)}"
        )
    logger.info("KV cache: %d blocks x %d tokens = %d tokens", num, block_size, num * block_size)
    return num


def _kv_way_out(config: "EngineConfig", device: torch.device, max_model_len: int) -> str:
    """The flags that make room for one full sequence, with their current values."""
    cache, sched = config.cache, config.scheduler
    if device.type == "cuda":
        budget = (f"raise --gpu-memory-utilization (now {cache.gpu_memory_utilization}), lower "
                  f"--max-num-batched-tokens (now {sched.max_num_batched_tokens}; it sizes the activations)")
    else:
        budget = f"raise --kv-cache-memory-gb (now {cache.kv_cache_memory_gb})"
    return (f"{budget}, lower --max-model-len (now {max_model_len}), or store fewer bytes per token with "
            f"--kv-cache-dtype fp8")


def dummy_step(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
               block_size: int) -> tuple[SchedulerOutput, int]:
    """A max-size prefill step: max_num_batched_tokens tokens over up to max_num_seqs requests,
    every request sampling (so the logits and sampler peaks are included). Returns the step and
    the number of KV blocks its requests use (blocks 0..n-1)."""
    total = min(max_num_batched_tokens, max_num_seqs * max_model_len)
    num_seqs = max(1, min(max_num_seqs, total))
    per_seq = [total // num_seqs + (1 if i < total % num_seqs else 0) for i in range(num_seqs)]
    out = SchedulerOutput()
    next_block = 0
    for i, n in enumerate(per_seq):
        rid = f"dummy-{i}"
        num_blocks = (n + block_size - 1) // block_size
        out.add(rid, n, 0)
        out.new_requests.append(NewRequest(rid, [0] * n, [], SamplingParams(temperature=0, max_tokens=1), 0))
        out.new_block_ids[rid] = (0, list(range(next_block, next_block + num_blocks)))
        next_block += num_blocks
    return out, next_block


def profile_kv_budget(run_peak_step: Callable[[], int], utilization: float, graph_reserve: int) -> int:
    """Bytes left for KV after weights, activations and graphs. `run_peak_step` runs one
    max-size step on a scratch KV cache it allocates and frees, and returns the scratch bytes."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    weights = torch.cuda.memory_allocated()
    used_by_others = total - free - torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    scratch_bytes = run_peak_step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - weights - scratch_bytes
    torch.cuda.empty_cache()
    plan = MemoryPlan(total, utilization, max(0, used_by_others), weights, peak, graph_reserve)
    logger.info("memory plan: %s -> KV budget %.2f GiB", plan, plan.kv_budget / (1 << 30))
    if plan.kv_budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache (weights {weights / 2**30:.1f} GiB, activations "
            f"{peak / 2**30:.1f} GiB of {total * plan.utilization / 2**30:.1f} GiB allowed); "
            "raise --gpu-memory-utilization or lower --max-num-batched-tokens"
        )
    return plan.kv_budget


def model_weight_bytes(hf_config, dtype: torch.dtype, quant_config=None) -> int:
    """Bytes this rank's parameters and buffers take: the model built on the meta device (shapes
    only, nothing allocated), so a model that cannot fit is refused before loading anything."""
    from atom_core.models.registry import resolve_model_class

    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = resolve_model_class(hf_config)(hf_config, quant_config=quant_config)
    finally:
        torch.set_default_dtype(old_dtype)
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def check_weights_fit(weight_bytes: int, total_bytes: int, utilization: float, tp_size: int = 1,
                      quantized: bool = False) -> None:
    """ValueError naming what the weights need, what the GPU allows, and which options would
    help, when this rank's weights alone exceed total_bytes * utilization."""
    allowed = total_bytes * utilization
    if weight_bytes <= allowed:
        return
    gib = 1 << 30
    hints = []
    ranks = tp_size
    while weight_bytes * tp_size / ranks > allowed * 0.9 and ranks < 1024:  # leave room for KV and activations
        ranks *= 2
    if ranks < 1024:
        hints.append(f"--tensor-parallel-size {ranks} (about {weight_bytes * tp_size / ranks / gib:.0f} GiB per GPU)")
    if not quantized:
        hints.append("a quantized checkpoint (FP8 halves bf16 weights; its quantization_config is read from "
                     "config.json)")
    if weight_bytes < total_bytes * 0.95:
        hints.append(f"--gpu-memory-utilization {min(0.98, weight_bytes / total_bytes + 0.05):.2f}")
    raise ValueError(
        f"the model does not fit: its weights need {weight_bytes / gib:.1f} GiB per GPU, but the GPU has "
        f"{total_bytes / gib:.1f} GiB, of which {allowed / gib:.1f} GiB at gpu_memory_utilization {utilization}; "
        f"options: {'; '.join(hints)}"
    )
