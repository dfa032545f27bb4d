"""Shared argument checks for the Triton kernel wrappers.

The wrappers run inside CUDA-graph capture, so every check here looks only at host-side
metadata (dtype, shape, stride, device) and never at tensor values.
"""
from __future__ import annotations

import functools
import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; on the CPU (Triton's interpreter) a small
    stand-in, so the grid heuristics are still exercised."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def pin_triton_cache_dir(device_index: int = 0) -> str:
    """Point Triton's on-disk cache at Inductor's folder before anything compiles; returns it.

    Inductor sets TRITON_CACHE_DIR to its own folder when it first compiles a graph, but not
    when a later start loads that graph from its cache. Our kernels then went to Inductor's
    folder on the first start and were looked for in ~/.triton on the second, which compiled
    them all again (12 s for Llama-3-8B on the GPU machine). A user's setting is kept.
    """
    if "TRITON_CACHE_DIR" not in os.environ:
        from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

        os.environ["TRITON_CACHE_DIR"] = triton_cache_dir(device_index)
    return os.environ["TRITON_CACHE_DIR"]


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; expected one of: float16, bfloat16, float32")


def check_int(name: str, t: torch.Tensor) -> None:
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} has dtype {t.dtype}; expected int32 or int64")


def check_dim(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    # Kernels index rows through strides but assume unit stride inside a row (vector loads).
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} needs a contiguous last dim, got strides {t.stride()}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors are on different devices: {devices}")


class LaunchPlans(dict):
    """A kernel wrapper's launch plans by key (its inputs' layouts, host ints and the ids of the
    step's metadata tensors): what the layers of one step share, checked and chosen once. A plan
    keeps the tensors whose ids are in its key alive, so those ids cannot be reused by others.
    Bounded: past MAX_SIZE entries (earlier steps') it starts over."""

    MAX_SIZE = 256

    def get_or_make(self, key, make):
        plan = self.get(key)
        if plan is None:
            plan = make()
            if len(self) >= self.MAX_SIZE:
                self.clear()
            self[key] = plan
        return plan
