"""EngineConfig: every engine knob in one frozen dataclass, validated once on construction."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Literal

import torch

DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8) + tuple(range(16, 513, 16))


@dataclass(frozen=True)
class EngineConfig:
    """All engine settings. `model` is a local HF directory or `preset:NAME`.

    num_kv_blocks, when set, fixes the KV cache size; otherwise it is sized from
    gpu_memory_utilization on a GPU, or from kv_cache_memory_gb on the CPU.
    level: 0 eager; 1 CUDA graphs for decode; 2 torch.compile of the model (graph split at
    attention); 3 (default) compile + CUDA graphs. enforce_eager forces level 0.
    """

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_gb: float = 1.0
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    enforce_eager: bool = False
    level: int = 3
    cudagraph_capture_sizes: tuple[int, ...] = DEFAULT_CAPTURE_SIZES
    async_scheduling: bool = True
    num_scheduler_steps: int = 8
    load_format: Literal["auto", "dummy"] = "auto"
    tensor_parallel_size: int = 1
    trust_remote_code: bool = False
    torch_profiler_dir: str | None = None
    profiler_detailed: bool = False
    mark_trace: bool = False
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        def fail(name: str, why: str) -> None:
            raise ValueError(f"invalid engine option {name}={getattr(self, name)!r}: {why}")

        if not self.model:
            fail("model", "a model directory or preset:NAME is required")
        if self.dtype not in DTYPES and self.dtype not in DTYPE_ALIASES:
            fail("dtype", f"expected one of: {', '.join([*DTYPES, *DTYPE_ALIASES])}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            fail("device", "expected auto, cpu, cuda or cuda:N")
        if self.max_model_len is not None and self.max_model_len < 1:
            fail("max_model_len", "must be >= 1")
        if self.max_num_seqs < 1:
            fail("max_num_seqs", "must be >= 1")
        if self.max_num_batched_tokens < 1:
            fail("max_num_batched_tokens", "must be >= 1")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            fail("block_size", "must be a power of two")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            fail("num_kv_blocks", "must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            fail("gpu_memory_utilization", "must be in (0, 1]")
        if not self.kv_cache_memory_gb > 0:
            fail("kv_cache_memory_gb", "must be > 0")
        if self.level not in (0, 1, 2, 3):
            fail("level", "expected 0, 1, 2 or 3")
        if not self.cudagraph_capture_sizes or any(s < 1 for s in self.cudagraph_capture_sizes):
            fail("cudagraph_capture_sizes", "must be a non-empty list of positive batch sizes")
        if not 1 <= self.num_scheduler_steps <= 64:
            fail("num_scheduler_steps", "must be between 1 and 64")
        if self.load_format not in ("auto", "dummy"):
            fail("load_format", "expected auto or dummy")
        if self.tensor_parallel_size != 1:
            fail("tensor_parallel_size", "only 1 is supported so far")
        if not self.enable_chunked_prefill and self.max_model_len is not None:
            if self.max_num_batched_tokens < self.max_model_len:
                fail("max_num_batched_tokens", "must be >= max_model_len without chunked prefill")

    # Derived values: properties, never written back.
    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def sorted_capture_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(set(s for s in self.cudagraph_capture_sizes if s <= self.max_num_seqs)))

    @property
    def use_cuda_graphs(self) -> bool:
        return self.torch_device.type == "cuda" and not self.enforce_eager and self.level in (1, 3)

    @property
    def use_compile(self) -> bool:
        return (
            self.torch_device.type == "cuda"
            and not self.enforce_eager
            and self.level in (2, 3)
            and not self.mark_trace
        )

    def resolve_dtype(self, config_dtype: torch.dtype | None) -> torch.dtype:
        """auto: the checkpoint's bf16/fp16 on a GPU (bf16 if it says fp32); float32 on the CPU."""
        name = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if name != "auto":
            return DTYPES[name]
        if self.torch_device.type == "cpu":
            return torch.float32
        if config_dtype in (torch.float16, torch.bfloat16):
            return config_dtype
        return torch.bfloat16

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineConfig":
        """Build from keyword options, rejecting unknown names with the list of known ones."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known: {', '.join(sorted(names))}")
        if "cudagraph_capture_sizes" in kwargs and kwargs["cudagraph_capture_sizes"] is not None:
            kwargs["cudagraph_capture_sizes"] = tuple(kwargs["cudagraph_capture_sizes"])
        kwargs = {k: v for k, v in kwargs.items() if v is not None or k in _NULLABLE}
        return cls(model=os.fspath(model), **kwargs)


_NULLABLE = {"max_model_len", "num_kv_blocks", "tokenizer", "torch_profiler_dir"}
