"""cuBLAS bf16 GEMM time against the row count M on Llama-3-8B's four linears (a diagnostic):
whether a mixed step of M tokens pays for M rows or for the next whole row tile.

    python3 tests/gpu/bench_gemm_rows.py [--m 256,384,...]
"""
from __future__ import annotations

import argparse

import torch

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def time_us(fn, iters: int = 50) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", default="256,320,384,416,448,480,512,544,566,576,640,704,768,1024,2048")
    args = parser.parse_args()
    ms = [int(v) for v in args.m.split(",")]
    weights = {name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for name, (n, k) in SHAPES.items()}
    print(f"{'M':>5} " + " ".join(f"{name:>14}" for name in SHAPES) + f" {'layer us':>9} {'TFLOP/s':>8} {'us/row':>7}")
    for m in ms:
        cells, total, flops = [], 0.0, 0.0
        for name, (n, k) in SHAPES.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            us = time_us(lambda: torch.nn.functional.linear(x, weights[name]))
            total += us
            flops += 2 * m * n * k
            cells.append(f"{us:7.1f} ({2 * m * n * k / us / 1e6:4.0f})")
        print(f"{m:>5} " + " ".join(cells) + f" {total:9.1f} {flops / total / 1e6:8.0f} {total / m:7.3f}")


if __name__ == "__main__":
    main()
