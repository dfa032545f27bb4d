"""GPU memory sizing: what is left for KV blocks after weights, activations and graphs.

budget = total * gpu_memory_utilization - (memory other processes hold) - weights
         - peak activations of a max-size step (measured with a dummy step) - graph reserve.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from atom_core.engine.scheduler import ScheduledBatch
from atom_core.engine.sequence import Sequence
from atom_core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from atom_core.engine.model_runner import ModelRunner

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


def dummy_batch(runner: "ModelRunner", block_offset: int = 0) -> ScheduledBatch:
    """A max-size prefill step: max_num_batched_tokens tokens over up to max_num_seqs sequences,
    every sequence sampling (so the logits and sampler peaks are included)."""
    cfg = runner.config
    total = min(cfg.max_num_batched_tokens, cfg.max_num_seqs * runner.max_model_len)
    num_seqs = max(1, min(cfg.max_num_seqs, total))
    per_seq = [total // num_seqs + (1 if i < total % num_seqs else 0) for i in range(num_seqs)]
    batch = ScheduledBatch()
    next_block = block_offset
    for i, n in enumerate(per_seq):
        seq = Sequence(f"dummy-{i}", [0] * n, SamplingParams(temperature=0, max_tokens=1))
        num_blocks = (n + runner.block_size - 1) // runner.block_size
        seq.block_table = list(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n)
    return batch


def profile_kv_budget(runner: "ModelRunner") -> int:
    """Run one dummy max-size step on a scratch KV cache and return the bytes left for KV."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    weights = torch.cuda.memory_allocated()
    used_by_others = total - free - torch.cuda.memory_reserved()
    batch = dummy_batch(runner)
    scratch_blocks = sum(len(s.block_table) for s in batch.seqs)
    torch.cuda.reset_peak_memory_stats()
    runner.allocate_kv_cache(scratch_blocks)
    runner.execute(batch)
    torch.cuda.synchronize()
    scratch_bytes = runner.kv_cache.numel() * runner.kv_cache.element_size()
    peak = torch.cuda.max_memory_allocated() - weights - scratch_bytes
    runner.release_kv_cache()
    torch.cuda.empty_cache()
    plan = MemoryPlan(total, runner.config.gpu_memory_utilization, max(0, used_by_others), weights, peak,
                      GRAPH_RESERVE_BYTES if runner.config.use_cuda_graphs else 0)
    logger.info("memory plan: %s -> KV budget %.2f GiB", plan, plan.kv_budget / (1 << 30))
    if plan.kv_budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache (weights {weights / 2**30:.1f} GiB, activations "
            f"{peak / 2**30:.1f} GiB of {total * plan.utilization / 2**30:.1f} GiB allowed); "
            "raise gpu_memory_utilization or lower max_num_batched_tokens"
        )
    return plan.kv_budget
