"""Micro-benchmark (CUDA): unquantized decode linears, F.linear (cuBLAS) vs the Triton GEMV of
dense_gemv.py, at M = 1, 2, 4 tokens on Llama-3-8B and Llama-3.1-70B projection shapes, whole (TP=1)
and per rank at TP=2. CUDA-graph medians in us and the weight stream's TB/s (bf16 weights; x and
the output are noise at these M), against the bytes floor at --floor-tbs.

  python -m atom_core.kernels.triton.dense_gemv_bench [--m 1,2,4] [--floor-tbs 3.0]

Weight values do not affect speed. Each timed call runs over enough weight copies (>= 160 MB
together) that they cannot stay in the 50-60 MB L2 between replays; times are per copy.
Not run on a GPU yet (written without one).
"""
from __future__ import annotations

import argparse

import torch

from atom_core.kernels.triton.fp8_bench import SHAPES as FP8_SHAPES

# model -> projection -> (N, K) at TP=1; TP=2 halves N of the column-parallel ones (qkv, gate_up)
# and K of the row-parallel ones (o, down)
SHAPES = {
    "llama-3-8b": {**FP8_SHAPES["llama-3-8b"], "lm_head": (128256, 4096)},
    "llama-3.1-70b": {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192), "down": (8192, 28672),
                      "lm_head": (128256, 8192)},
}
ROW_PARALLEL = ("o", "down")
COPIES_BYTES = 160 << 20  # more than twice the L2 of an H100 (50 MB) or H200 (60 MB)


def shapes(tp: int) -> list[tuple[str, str, int, int]]:
    out = []
    for model, projections in SHAPES.items():
        for name, (n, k) in projections.items():
            n_rank, k_rank = (n, k // tp) if name in ROW_PARALLEL else (n // tp, k)
            out.append((model, name, n_rank, k_rank))
    return out


def main() -> None:
    from atom_core.kernels.bench_kernels import bench_ms
    from atom_core.kernels.triton.dense_gemv import dense_gemv

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", default="1,2,4", help="tokens (rows of x), each <= 4")
    ap.add_argument("--floor-tbs", type=float, default=3.0, help="HBM read rate of the floor (H100 ~3.0, H200 ~4.8)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("dense_gemv_bench needs a CUDA GPU")
    ms = [int(v) for v in args.m.split(",")]
    print(f"{torch.cuda.get_device_name()}: bf16 linears, median us per call in a CUDA graph; TB/s of the weights")
    print(f"{'model':>14} {'proj':>8} {'tp':>3} {'N':>7} {'K':>6} {'M':>2} {'linear':>8} {'gemv':>8} "
          f"{'lin TB/s':>8} {'gemv TB/s':>9} {'floor':>7}")
    for tp in (1, 2):
        for model, name, n, k in shapes(tp):
            copies = -(-COPIES_BYTES // (n * k * 2))
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            floor = n * k * 2 / (args.floor_tbs * 1e12) * 1e6
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                t_lin = bench_ms(lambda: [torch.nn.functional.linear(x, w) for w in ws]) * 1000 / copies
                t_gemv = bench_ms(lambda: [dense_gemv(x, w) for w in ws]) * 1000 / copies
                tbs = lambda us: n * k * 2 / (us * 1e-6) / 1e12  # noqa: E731
                print(f"{model:>14} {name:>8} {tp:>3} {n:>7} {k:>6} {m:>2} {t_lin:>8.1f} {t_gemv:>8.1f} "
                      f"{tbs(t_lin):>8.2f} {tbs(t_gemv):>9.2f} {floor:>7.1f}")
            del ws


if __name__ == "__main__":
    main()
