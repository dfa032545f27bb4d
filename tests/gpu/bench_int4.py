"""W4A16 and INT8 W8A8 GEMMs against bf16 (cuBLAS through F.linear) on Llama-3-8B's linear
shapes, timed in CUDA graphs (launch gaps excluded), each checked against its torch reference.

    python tests/gpu/bench_int4.py [--out FILE.json]

Prints one row per (shape, M): microseconds of bf16 / W4A16 / W8A8 and, for W4A16, the weight
bytes read per microsecond (GB/s; the H100's HBM reads ~3.0 TB/s).
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from atom_core.kernels.triton.int8 import int8_w8a8_gemm
from atom_core.kernels.triton.w4a16 import w4a16_gemm
from atom_core.quant.int_ops import int8_w8a8_gemm_ref, w4a16_gemm_ref

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
GROUP = 128


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--m", default="1,4,16,128,1024")
    args = parser.parse_args()
    dev, rows = "cuda", []
    for name, (n, k) in SHAPES.items():
        qweight = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device=dev)
        scales = (torch.rand(n, k // GROUP, device=dev) * 0.01).to(torch.bfloat16)
        w_bf16 = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        w_i8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, device=dev)
        w_i8_scale = torch.rand(n, 1, device=dev) * 0.01
        for m in map(int, args.m.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            err4 = _rel(w4a16_gemm(x, qweight, scales, None, GROUP), w4a16_gemm_ref(x, qweight, scales, None, GROUP))
            err8 = _rel(int8_w8a8_gemm(x, w_i8, w_i8_scale), int8_w8a8_gemm_ref(x, w_i8, w_i8_scale))
            t_bf16 = do_bench_cudagraph(lambda: F.linear(x, w_bf16)) * 1e3
            t_w4 = do_bench_cudagraph(lambda: w4a16_gemm(x, qweight, scales, None, GROUP)) * 1e3
            t_w8 = do_bench_cudagraph(lambda: int8_w8a8_gemm(x, w_i8, w_i8_scale)) * 1e3
            w4_bytes = n * k // 2 + scales.numel() * 2
            rows.append(dict(shape=name, n=n, k=k, m=m, bf16_us=t_bf16, w4a16_us=t_w4, w8a8_us=t_w8,
                             w4a16_gbps=w4_bytes / t_w4 / 1e3, bf16_gbps=n * k * 2 / t_bf16 / 1e3,
                             w4a16_rel_err=err4, w8a8_rel_err=err8))
    print(f"{'shape':8} {'M':>5} {'bf16 us':>8} {'w4a16 us':>9} {'w8a8 us':>8} {'w4 GB/s':>8} {'bf16 GB/s':>9} "
          f"{'w4 err':>8} {'w8 err':>8}")
    for r in rows:
        print(f"{r['shape']:8} {r['m']:5d} {r['bf16_us']:8.1f} {r['w4a16_us']:9.1f} {r['w8a8_us']:8.1f} "
              f"{r['w4a16_gbps']:8.0f} {r['bf16_gbps']:9.0f} {r['w4a16_rel_err']:8.1e} {r['w8a8_rel_err']:8.1e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


if __name__ == "__main__":
    main()
