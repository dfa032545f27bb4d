"""LoRA adapters: what a request names (`LoRARequest`), the adapters an engine serves
(`LoRARegistry`) and PEFT's files read and checked (`adapter.py`).

This package imports nothing else of atom_core: the request object rides on SamplingParams, so the
step message, the tensor-parallel broadcast and the worker's copy of each request carry it unchanged.
The GPU side is model_ops/lora.py (the stacked slot weights a linear applies) and worker/lora_slots.py
(which adapter sits in which slot).
"""
from __future__ import annotations

from atom_core.lora.adapter import LoRAAdapter, check_adapter_shapes, load_adapter
from atom_core.lora.registry import LoRAModule, LoRARegistry, LoRARequest, as_lora_request, parse_lora_modules

__all__ = ["LoRAAdapter", "LoRAModule", "LoRARegistry", "LoRARequest", "as_lora_request", "check_adapter_shapes",
           "load_adapter", "parse_lora_modules"]
