"""Micro-benchmark (CUDA): unquantized decode linears, F.linear (cuBLAS) vs the Triton GEMV of
dense_gemv.py, at M = 1, 2, 4 tokens on Llama-3-8B and Llama-3.1-70B projection shapes, whole (TP=1)
and per rank at TP=2. CUDA-graph medians in us and the weight stream's TB/s (bf16 weights; x and
the output are noise at these M), against the bytes floor at --floor-tbs.

  python -m benchmarks.kernels.dense_gemv_bench [--m 1,2,4] [--floor-tbs 3.0] [--sweep]
      [--model llama-3-8b,llama-3.1-70b] [--tp 1,2]

Weight values do not affect speed. Each timed call runs over enough weight copies (>= 160 MB
together) that they cannot stay in the 50-60 MB L2 between replays; times are per copy.
`--sweep` times the GEMV's tiles around the default (BLOCK_K x weights a thread a step x split-K)
per shape instead of the table: the default tiles came from the FP8 GEMV (1-byte weights) and
were not swept on bf16; at 1 token the TP=2 qkv and o shapes ran at 1.3-1.4x their floor
(docs/PERFORMANCE.md 2026-11-26, fourth session). The sweep has not run on a GPU yet.
"""
from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from benchmarks.kernels.fp8_bench import SHAPES as FP8_SHAPES

# model -> projection -> (N, K) at TP=1; TP=2 halves N of the column-parallel ones (qkv, gate_up)
# and K of the row-parallel ones (o, down)
SHAPES = {
    "llama-3-8b": {**FP8_SHAPES["llama-3-8b"], "lm_head": (128256, 4096)},
    "llama-3.1-70b": {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192), "down": (8192, 28672),
                      "lm_head": (128256, 8192)},
}
ROW_PARALLEL = ("o", "down")
COPIES_BYTES = 160 << 20  # more than twice the L2 of an H100 (50 MB) or H200 (60 MB)


def shapes(tp: int, models: tuple[str, ...] | None = None) -> list[tuple[str, str, int, int]]:
    """(model, projection, N, K) per rank at `tp`, for `models` (default: all of SHAPES)."""
    out = []
    for model, projections in SHAPES.items():
        if models is not None and model not in models:
            continue
        for name, (n, k) in projections.items():
            n_rank, k_rank = (n, k // tp) if name in ROW_PARALLEL else (n // tp, k)
            out.append((model, name, n_rank, k_rank))
    return out


def weight_copies(floor_tbs: float, tps: tuple[int, ...] = (1, 2), models: tuple[str, ...] | None = None):
    """Per shape at each of `tps`: (model, proj, tp, N, K, bf16 weight copies past the L2, the floor in us)."""
    for tp in tps:
        for model, name, n, k in shapes(tp, models):
            copies = -(-COPIES_BYTES // (n * k * 2))
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            yield model, name, tp, n, k, ws, n * k * 2 / (floor_tbs * 1e12) * 1e6
            del ws


def sweep_configs(base):
    """Tiles around `base` (a default_dense_gemv_config): BLOCK_K 128-1024 x 8-32 bf16 weights a
    thread a step (16-64 bytes) x split-K {1, base, 2 x base}; duplicates dropped, order kept."""
    out = []
    for bk in (128, 256, 512, 1024):
        for per_thread in (8, 16, 32):
            bn = max(1, per_thread * 32 * base.num_warps // bk)
            for split in (1, base.split_k, 2 * base.split_k):
                cfg = replace(base, block_n=bn, block_k=bk, split_k=split)
                if cfg not in out:
                    out.append(cfg)
    return out


def _sweep(ms: list[int], floor_tbs: float, tps: tuple[int, ...], models: tuple[str, ...] | None) -> None:
    from benchmarks.kernels.bench_kernels import bench_ms
    from atom_core.kernels.triton.common import sm_count
    from atom_core.kernels.triton.dense_gemv import default_dense_gemv_config, dense_gemv, dense_gemv_ref

    print(f"{'model':>14} {'proj':>8} {'tp':>3} {'M':>2} {'BK':>5} {'BN':>4} {'split':>5} {'us':>8} {'floor':>7} default")
    print("(a tile whose result is off the float32 reference by more than bf16 rounding prints WRONG)")
    for model, name, tp, n, k, ws, floor in weight_copies(floor_tbs, tps, models):
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            base = default_dense_gemv_config(m, n, k, 2, sm_count(x.device))
            want = dense_gemv_ref(x, ws[0]).float()
            for cfg in sweep_configs(base):
                got = dense_gemv(x, ws[0], config=cfg).float()
                wrong = ((got - want).norm() / want.norm()).item() > 1e-2
                us = bench_ms(lambda: [dense_gemv(x, w, config=cfg) for w in ws]) * 1000 / len(ws)
                print(f"{model:>14} {name:>8} {tp:>3} {m:>2} {cfg.block_k:>5} {cfg.block_n:>4} {cfg.split_k:>5} "
                      f"{us:>8.1f} {floor:>7.1f} {'*' if cfg == base else ''}{' WRONG' if wrong else ''}", flush=True)


def main() -> None:
    from benchmarks.kernels.bench_kernels import bench_ms
    from atom_core.kernels.triton.dense_gemv import dense_gemv

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", default="1,2,4", help="tokens (rows of x), each <= 4")
    ap.add_argument("--floor-tbs", type=float, default=3.0, help="HBM read rate of the floor (H100 ~3.0, H200 ~4.8)")
    ap.add_argument("--sweep", action="store_true", help="time the GEMV's tiles per shape instead of the table")
    ap.add_argument("--model", default=",".join(SHAPES), help=f"models whose shapes run, of: {', '.join(SHAPES)}")
    ap.add_argument("--tp", default="1,2", help="tensor-parallel sizes whose per-rank shapes run (1 and/or 2)")
    args = ap.parse_args()
    ms = [int(v) for v in args.m.split(",")]
    if any(not 1 <= m <= 4 for m in ms):
        raise SystemExit(f"--m takes token counts from 1 to 4 (the GEMV's rows), got {args.m}")
    models = tuple(v.strip() for v in args.model.split(","))
    if unknown := [v for v in models if v not in SHAPES]:
        raise SystemExit(f"--model: unknown {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    tps = tuple(int(v) for v in args.tp.split(","))
    if any(tp not in (1, 2) for tp in tps):
        raise SystemExit(f"--tp takes 1 and/or 2, got {args.tp}")
    if not torch.cuda.is_available():
        raise SystemExit("dense_gemv_bench needs a CUDA GPU")
    if args.sweep:
        return _sweep(ms, args.floor_tbs, tps, models)
    print(f"{torch.cuda.get_device_name()}: bf16 linears, median us per call in a CUDA graph; TB/s of the weights")
    print(f"{'model':>14} {'proj':>8} {'tp':>3} {'N':>7} {'K':>6} {'M':>2} {'linear':>8} {'gemv':>8} "
          f"{'lin TB/s':>8} {'gemv TB/s':>9} {'floor':>7}")
    for model, name, tp, n, k, ws, floor in weight_copies(args.floor_tbs, tps, models):
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_lin = bench_ms(lambda: [torch.nn.functional.linear(x, w) for w in ws]) * 1000 / len(ws)
            t_gemv = bench_ms(lambda: [dense_gemv(x, w) for w in ws]) * 1000 / len(ws)
            tbs = lambda us: n * k * 2 / (us * 1e-6) / 1e12  # noqa: E731
            print(f"{model:>14} {name:>8} {tp:>3} {n:>7} {k:>6} {m:>2} {t_lin:>8.1f} {t_gemv:>8.1f} "
                  f"{tbs(t_lin):>8.2f} {tbs(t_gemv):>9.2f} {floor:>7.1f}")


if __name__ == "__main__":
    main()
