"""Micro-benchmark (CUDA): the FP8 linear (Triton per-token quantization + torch._scaled_mm
row-wise) vs bf16 F.linear on Llama-3-8B's projection shapes, at M = 1 and 32 tokens, with
the bytes-read floor (weights only) at 3.0 TB/s. Prints one table; `python -m
atom_core.kernels.triton.fp8_bench`.
"""
from __future__ import annotations

import torch

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)


def _time_us(fn) -> float:
    """Median of CUDA-graph replays (launch overhead as in a captured decode step)."""
    from atom_core.kernels.bench_kernels import bench_ms

    return bench_ms(fn) * 1000


def main() -> None:
    from atom_core.kernels.triton.fp8 import quantize_fp8_per_token
    from atom_core.quant.fp8_ops import fp8_linear, quantize_fp8_per_token as ref_quant

    print(f"{'shape':>8} {'M':>3} {'bf16 us':>8} {'fp8 us':>8} {'quant us':>8} {'mm us':>8} {'fp8 floor us':>12}")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        qw, sw = ref_quant(w)
        for m in (1, 32):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            qx, sx = quantize_fp8_per_token(x)
            t_bf16 = _time_us(lambda: torch.nn.functional.linear(x, w))
            t_fp8 = _time_us(lambda: fp8_linear(x, qw, sw))
            t_quant = _time_us(lambda: quantize_fp8_per_token(x))
            t_mm = _time_us(lambda: torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw.reshape(1, -1),
                                                     out_dtype=torch.bfloat16))
            floor = n * k / 3.0e12 * 1e6
            print(f"{name:>8} {m:>3} {t_bf16:8.1f} {t_fp8:8.1f} {t_quant:8.1f} {t_mm:8.1f} {floor:12.1f}")


if __name__ == "__main__":
    main()
