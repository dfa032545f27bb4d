"""Which LoRA adapter sits in which GPU slot: the worker's side of multi-LoRA.

`LoRASlots` attaches a LoRALinear (model_ops/lora.py) to every linear an adapter can target, keeps
up to max_loras adapters in the slot tables (least recently used out first, never one the step uses)
and up to max_cpu_loras read from disk in a CPU cache (least recently used out first; an adapter
dropped from it is read again when next used), and writes each step's per-token slots before the
forward. The scheduler never puts more than max_loras adapters in a step, so the step's adapters
always fit. Each tensor-parallel rank cuts its own shard of every adapter (column-parallel: B's
rows of this rank's outputs; row-parallel: A's columns of its inputs). `NoLoRASlots` is the same
interface with adapters off.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from atom_core.config import LoRAConfig
from atom_core.lora import LoRAAdapter, LoRARequest, load_adapter
from atom_core.lora.adapter import TARGET_MODULES
from atom_core.model_ops.linear import LinearBase
from atom_core.model_ops.lora import LoRABatch, LoRALinear
from atom_core.worker.batch_builder import FlatBatch, to_device
from atom_core.worker.input_batch import RequestState


class NoLoRASlots:
    """Adapters off: nothing to attach or prepare."""

    num_slot_writes = 0

    def prepare(self, flat: FlatBatch, states: list[RequestState]) -> None:
        return None

    def clear(self) -> None:
        return None


def lora_targets(model) -> list[tuple[LinearBase, list[tuple[str, object]]]]:
    """Every linear of `model` an adapter can target, with the HF module path and shard id of each of
    its sub-projections (a merged qkv_proj: q_proj/"q", k_proj/"k", v_proj/"v")."""
    packed: dict[str, list[tuple[str, object]]] = {}
    for param, checkpoint, shard in getattr(model, "stacked_params_mapping", []):
        packed.setdefault(param, []).append((checkpoint, shard))
    targets = []
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase):
            continue
        parent, _, leaf = name.rpartition(".")
        subs = packed.get(leaf, [(leaf, None)])
        if all(sub in TARGET_MODULES for sub, _ in subs):
            targets.append((module, [(f"{parent}.{sub}", shard) for sub, shard in subs]))
    return targets


def _shard(layer: LinearBase, a: torch.Tensor, b: torch.Tensor, shard) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of one sub-projection's A [r, in] and B [out, r]."""
    if layer.tp_dim == 1:
        size = layer.input_size
        return a.narrow(1, layer.tp_rank * size, size), b
    if layer.tp_dim == 0:
        if shard is None:
            size = layer.output_sizes[0]
            return a, b.narrow(0, layer.tp_rank * size, size)
        _, size, start = layer._shard_range(shard, b.shape[0])
        return a, b.narrow(0, start, size)
    return a, b


class LoRASlots:
    """Contract: built after the model, before KV sizing (the tables count as weights); `prepare(flat,
    states)` before each step's forward, whose distinct adapters number at most max_loras; `clear()`
    before a forward of no request (an idle replica's). Single-threaded, as the runner."""

    def __init__(self, config: LoRAConfig, model, dtype: torch.dtype, device: torch.device, max_num_tokens: int):
        self.max_loras = config.max_loras
        self.max_rank = config.max_lora_rank
        self.cpu_cache_size = config.cpu_cache_size
        self.dtype, self.device = dtype, device
        self.batch = LoRABatch(config.max_loras, max_num_tokens, device)
        self.targets = lora_targets(model)
        assert self.targets, "--enable-lora on a model with no linear an adapter can target"
        for layer, subs in self.targets:
            layer.lora = LoRALinear(self.batch, layer.input_size, layer.output_sizes if len(subs) > 1
                                    else [sum(layer.output_sizes)], self.max_rank, dtype, device)
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self.cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()  # adapter id -> weights, same order
        self.num_slot_writes = 0
        self.num_disk_reads = 0

    def prepare(self, flat: FlatBatch, states: list[RequestState]) -> None:
        requests = [s.sampling_params.lora_request for s in states]
        if not any(requests):
            self.batch.clear()
            return
        step_ids = {r.lora_int_id for r in requests if r is not None}
        assert len(step_ids) <= self.max_loras, f"{len(step_ids)} adapters in one step; max_loras is {self.max_loras}"
        slots = np.array([-1 if r is None else self._slot(r, step_ids) for r in requests], dtype=np.int32)
        qsl = flat.attn.query_start_loc
        token_slots = torch.repeat_interleave(to_device(slots, self.device), (qsl[1:] - qsl[:-1]).long(),
                                              output_size=flat.num_tokens)
        self.batch.set(token_slots)

    def clear(self) -> None:
        self.batch.clear()

    def _slot(self, request: LoRARequest, step_ids: set[int]) -> int:
        """The adapter's slot, writing it there first if it is not resident (into a free slot, else
        the least recently used one no adapter of this step holds)."""
        lora_id = request.lora_int_id
        slot = self.slot_of.get(lora_id)
        if slot is not None:
            self.slot_of.move_to_end(lora_id)
            return slot
        if len(self.slot_of) < self.max_loras:
            slot = min(set(range(self.max_loras)) - set(self.slot_of.values()))
        else:
            victim = next(i for i in self.slot_of if i not in step_ids)
            slot = self.slot_of.pop(victim)
        self._write(slot, self._adapter(request))
        self.slot_of[lora_id] = slot
        return slot

    def _adapter(self, request: LoRARequest) -> LoRAAdapter:
        adapter = self.cpu.get(request.lora_int_id)
        if adapter is not None:
            self.cpu.move_to_end(request.lora_int_id)
            return adapter
        adapter = load_adapter(request.lora_path, self.max_rank)  # checked when registered: this reads it again
        self.num_disk_reads += 1
        self.cpu[request.lora_int_id] = adapter
        while len(self.cpu) > self.cpu_cache_size:
            self.cpu.popitem(last=False)
        return adapter

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        used = set()
        for layer, subs in self.targets:
            parts = []
            for path, shard in subs:
                pair = adapter.weights.get(path)
                if pair is None:
                    parts.append(None)
                    continue
                used.add(path)
                a, b = _shard(layer, *pair, shard)
                parts.append((a.to(self.device, self.dtype), (b.float() * adapter.scaling).to(self.device, self.dtype)))
            layer.lora.set_slot(slot, parts)
        missing = sorted(set(adapter.weights) - used)
        assert not missing, f"LoRA adapter {adapter.path!r}: modules {missing[:3]} match no linear of the model"
        self.num_slot_writes += 1


def build_lora_slots(config: LoRAConfig, model, dtype: torch.dtype, device: torch.device,
                     max_num_tokens: int) -> LoRASlots | NoLoRASlots:
    if not config.enable_lora:
        return NoLoRASlots()
    return LoRASlots(config, model, dtype, device, max_num_tokens)
