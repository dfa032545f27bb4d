"""Unquantized GEMV for decode (M <= 4 rows, Triton): y [M, N] = x [M, K] @ W^T (+ bias), W [N, K]
in x's dtype (bf16 / fp16 / fp32).

  dense_gemv(x, weight, bias)       the kernel
  dense_gemv_ref(x, weight, bias)   its torch reference (float32 matmul, rounded once)

Why: at batch 1 a linear is a weight stream, and its speed is the decode step's. cuBLAS runs a
one-row product on tiles built for many rows, so it streams weights well below the memory's
bandwidth, and further below on the half-width weights of tensor parallelism (measured: see
docs/PERFORMANCE.md). A GEMV makes one pass over the weights with no tensor-core tiles to fill.

The kernel is the weight-only FP8 GEMV's (fp8_gemv._fp8_gemv_kernel): a program streams BLOCK_N
weight rows once for all M rows of x, converts each weight to float32, FMAs in float32 in a fixed
order (deterministic), adds the bias in float32 and rounds once. Its weights here are x's dtype,
loaded 16 bytes a thread (8 bf16: the same register layout as x's), under a unit per-tensor scale
(one float32 1.0: multiplying a sum by it is exact). Split-K counts 2-byte weights in flight.

At 1 token it streams the weights faster than cuBLAS on most Llama shapes and the LM head (slower
on a few) and shortens the whole batch-1 step, so the linears' tables (quant/unquantized.py) send
1-token linears here (measured: see docs/PERFORMANCE.md). 1-token bf16 uses one row a program in
1,024-column steps (`default_dense_gemv_config`).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton

from atom_core.kernels.triton.common import check_same_device, sm_count
from atom_core.kernels.triton.fp8_gemv import (
    Fp8GemvConfig, check_gemv_config, default_fp8_gemv_config, launch_gemv, split_for_bytes_in_flight,
)

MAX_TOKENS = 4  # rows of x (the kernel keeps an accumulator per row)
_UNIT_SCALES: dict[torch.device, torch.Tensor] = {}


def _unit_scale(device: torch.device) -> torch.Tensor:
    if device not in _UNIT_SCALES:
        _UNIT_SCALES[device] = torch.ones(1, dtype=torch.float32, device=device)
    return _UNIT_SCALES[device]


def _check(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x2.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bf16, fp16 or fp32, got {x2.dtype}")
    if weight.dim() != 2 or weight.dtype != x2.dtype:
        raise ValueError(f"weight must be 2-D [N, K] in x's dtype {x2.dtype}, got {tuple(weight.shape)} {weight.dtype}")
    if x2.shape[0] > MAX_TOKENS:
        raise ValueError(f"the dense GEMV takes at most {MAX_TOKENS} rows of x, got {x2.shape[0]}")
    if x2.shape[1] != weight.shape[1]:
        raise ValueError(f"x has {x2.shape[1]} columns but weight is {tuple(weight.shape)} ([N, K])")
    if weight.stride(1) != 1 or (x2.shape[1] > 1 and x2.stride(1) != 1):
        raise ValueError(f"x and weight need contiguous rows, got strides {x2.stride()} and {weight.stride()}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    check_same_device(x=x2, weight=weight, **({} if bias is None else {"bias": bias}))


@functools.lru_cache(maxsize=None)  # dense_gemv asks on every eager call; a few shapes per model
def default_dense_gemv_config(m: int, n: int, k: int, elem_bytes: int, num_sms: int) -> Fp8GemvConfig:
    """The FP8 GEMV's tiles, except one row of 2-byte weights: 8 weights (one 16-byte load) a
    thread a step over BLOCK_K 1,024, one weight row a program with 4 warps. A tile sweep found it
    fastest on every Llama-3-8B shape at TP=1 and 2, ahead of the FP8 GEMV's 32 weights a thread
    over BLOCK_K 512 (measured: see docs/PERFORMANCE.md): a 2-byte weight row is twice as wide in
    bytes, so fewer weights a thread keep the same bytes in flight with more rows in parallel."""
    cfg = default_fp8_gemv_config(m, n, k, elem_bytes, None, num_sms, w_bytes=elem_bytes)
    if m != 1 or elem_bytes != 2:  # not swept: M 2-4 (no linear sends them here), fp32
        return cfg
    bk = max(16, min(1024, triton.next_power_of_2(k)))
    bn = max(1, 8 * 32 * cfg.num_warps // bk)
    return Fp8GemvConfig(bn, bk, cfg.num_warps, split_for_bytes_in_flight(triton.cdiv(k, bk), n * bk * elem_bytes, num_sms))


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
               config: Fp8GemvConfig | None = None) -> torch.Tensor:
    """x [*, K] with at most MAX_TOKENS rows, weight [N, K] in x's dtype -> [*, N] in x's dtype."""
    shape, n = x.shape, weight.shape[0]
    x2 = x.reshape(-1, shape[-1])
    if x2.shape[1] > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    _check(x2, weight, bias)
    cfg = config or default_dense_gemv_config(x2.shape[0], n, weight.shape[1], x2.element_size(), sm_count(x.device))
    check_gemv_config(cfg, None)
    return launch_gemv(x2, weight, _unit_scale(x2.device), (0, 0), 1, None, bias, cfg).reshape(*shape[:-1], n)


def dense_gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A float32 matmul (+ the bias in float32), rounded once to x's dtype."""
    y = x.float().reshape(-1, x.shape[-1]) @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
