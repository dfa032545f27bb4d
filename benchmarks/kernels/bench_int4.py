"""W4A16 and INT8 W8A8 GEMMs against bf16 (cuBLAS through F.linear) on Llama-3-8B's linear
shapes, timed in CUDA graphs (launch gaps excluded), each checked against its torch reference.

    python -m benchmarks.kernels.bench_int4 [--out FILE.json]
    python -m benchmarks.kernels.bench_int4 --m 1 --kernels triton,f16x2     (the GEMV kernels side by side)

Prints one row per (shape, M): microseconds of bf16 / W4A16 / W8A8 and, for W4A16, the weight
bytes read per microsecond (GB/s; the H100's HBM reads ~3.0 TB/s). `w4 split` is the W4A16 GEMV
(M <= 8) with K split by `w4a16.gemv_split_k` (`sp`: the splits; the default path runs 1).
`--kernels` also times each GEMV program on the same weights: f16x2 (what the kernel layout with bf16
x runs) and triton (the float32 GEMV, what other layouts run).
The int4 weights are random words read in the kernel layout (INT4_INTERLEAVE), as the engine's
int4 linears store them.
Each timed call runs over enough weight copies (>= 160 MB together) that they cannot stay in the
50-60 MB L2 between replays (the int4 qkv, o and down weights alone would); times are per copy.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from atom_core.kernels.triton.common import sm_count
from atom_core.kernels.triton.int8 import int8_w8a8_gemm
from atom_core.kernels.triton.w4a16 import GEMV_MAX_M, gemv_split_k, gemv_split_step, w4a16_gemm
from atom_core.quant.int_ops import INT4_INTERLEAVE, int8_w8a8_gemm_ref, w4a16_gemm_ref

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
GROUP = 128
COPIES_BYTES = 160 << 20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--m", default="1,4,16,128,1024")
    parser.add_argument("--splits", default="", help="also time the GEMV at these K splits (M <= 8), e.g. 2,4")
    parser.add_argument("--tiles", default="", help="also time the GEMV at each of these tiles, BLOCK_N x BLOCK_KW "
                                                     "(4 warps; sN: N pipeline stages), instead of the autotuner's pick, e.g. 16x128,16x64s3")
    parser.add_argument("--kernels", default="", help="also time the GEMV (M <= 8) with each of these programs: "
                                                       f"{', '.join(GEMV_KERNELS)}, e.g. triton,f16x2")
    args = parser.parse_args()
    unknown = [kind for kind in filter(None, args.kernels.split(",")) if kind not in GEMV_KERNELS]
    if unknown:
        raise SystemExit(f"unknown --kernels {unknown}; expected some of: {', '.join(GEMV_KERNELS)}")
    dev, rows = "cuda", []
    for name, (n, k) in SHAPES.items():
        copies = -(-COPIES_BYTES // (n * k // 2))  # by the int4 bytes: the bf16 and int8 copies exceed the L2 too
        qweights = [torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device=dev) for _ in range(copies)]
        scales = [(torch.rand(n, k // GROUP, device=dev) * 0.01).to(torch.bfloat16) for _ in range(copies)]
        w_bf16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        w_i8 = [torch.randint(-128, 128, (n, k), dtype=torch.int8, device=dev) for _ in range(copies)]
        w_i8_scale = torch.rand(n, 1, device=dev) * 0.01
        split = gemv_split_k(n, k, gemv_split_step(torch.device(dev)), sm_count(torch.device(dev)))
        per_copy = lambda fn: do_bench_cudagraph(lambda: [fn(i) for i in range(copies)]) * 1e3 / copies  # noqa: E731
        for m in map(int, args.m.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            w4 = lambda i, **kw: w4a16_gemm(x, qweights[i], scales[i], None, GROUP, interleave=INT4_INTERLEAVE, **kw)  # noqa: E731
            ref4 = w4a16_gemm_ref(x, qweights[0], scales[0], None, GROUP, interleave=INT4_INTERLEAVE)
            err4 = _rel(w4(0), ref4)
            err4s = _rel(w4(0, gemv_split=split), ref4)
            err8 = _rel(int8_w8a8_gemm(x, w_i8[0], w_i8_scale), int8_w8a8_gemm_ref(x, w_i8[0], w_i8_scale))
            t_bf16 = per_copy(lambda i: F.linear(x, w_bf16[i]))
            t_w4 = per_copy(lambda i: w4(i))
            t_w4s = (per_copy(lambda i: w4(i, gemv_split=split))
                     if m <= GEMV_MAX_M and split > 1 else t_w4)
            t_w8 = per_copy(lambda i: int8_w8a8_gemm(x, w_i8[i], w_i8_scale))
            w4_bytes = n * k // 2 + scales[0].numel() * 2
            forced = {sp: per_copy(lambda i, sp=sp: w4(i, gemv_split=sp)) for sp in map(int, filter(None, args.splits.split(",")))
                      if m <= GEMV_MAX_M}
            if forced:
                print(f"{name} M={m} forced splits: " + ", ".join(f"{sp}: {t:.1f} us" for sp, t in forced.items()), flush=True)
            if args.tiles and m <= GEMV_MAX_M:
                print(f"{name} M={m} tiles: " + ", ".join(f"{t}: {_time_tile(t, per_copy, w4):.1f} us"
                                                         for t in args.tiles.split(",")), flush=True)
            kernels = {kind: _time_kernel(kind, per_copy, w4, ref4) for kind in filter(None, args.kernels.split(","))
                       if m <= GEMV_MAX_M}
            if kernels:
                cells = [f"{kind}: {t:.1f} us {w4_bytes / t / 1e3:.0f} GB/s (err {err:.1e})"
                         for kind, (t, err) in kernels.items()]
                print(f"{name} M={m} GEMV kernels: " + ", ".join(cells), flush=True)
            rows.append(dict(shape=name, n=n, k=k, m=m, bf16_us=t_bf16, w4a16_us=t_w4, w4a16_split_us=t_w4s,
                             **{f"w4a16_{kind}_us": t for kind, (t, _) in kernels.items()},
                             split=split if m <= GEMV_MAX_M else 1, w8a8_us=t_w8,
                             w4a16_gbps=w4_bytes / t_w4 / 1e3, w4a16_split_gbps=w4_bytes / t_w4s / 1e3,
                             bf16_gbps=n * k * 2 / t_bf16 / 1e3, w4a16_rel_err=max(err4, err4s), w8a8_rel_err=err8))
        del qweights, scales, w_bf16, w_i8
    print(f"{'shape':8} {'M':>5} {'bf16 us':>8} {'w4a16 us':>9} {'w4 split':>9} {'sp':>3} {'w8a8 us':>8} {'w4 GB/s':>8} "
          f"{'split GB/s':>10} {'bf16 GB/s':>9} {'w4 err':>8} {'w8 err':>8}")
    for r in rows:
        print(f"{r['shape']:8} {r['m']:5d} {r['bf16_us']:8.1f} {r['w4a16_us']:9.1f} {r['w4a16_split_us']:9.1f} "
              f"{r['split']:3d} {r['w8a8_us']:8.1f} {r['w4a16_gbps']:8.0f} {r['w4a16_split_gbps']:10.0f} "
              f"{r['bf16_gbps']:9.0f} {r['w4a16_rel_err']:8.1e} {r['w8a8_rel_err']:8.1e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


def _time_tile(tile: str, per_copy, w4) -> float:
    """The GEMV at one tile: the autotuner given only that config (its cache cleared before and after)."""
    import triton

    from atom_core.kernels.triton import w4a16

    tuner = w4a16._w4a16_gemv_tuned
    saved = tuner.configs
    shape, _, stages = tile.partition("s")  # "16x128" or "16x128s3" (software-pipelined loads)
    bn, bkw = map(int, shape.split("x"))
    config = triton.Config({"BLOCK_N": bn, "BLOCK_KW": bkw}, num_warps=4, num_stages=int(stages or 1))
    tuner.configs, tuner.cache = [config], {}
    try:
        return per_copy(lambda i: w4(i))
    finally:
        tuner.configs, tuner.cache = saved, {}


GEMV_KERNELS = ("f16x2", "triton")


def _time_kernel(kind: str, per_copy, w4, ref: torch.Tensor) -> tuple[float, float]:
    """(us, relative error) of the W4A16 call with its GEMV program replaced by `kind`'s for this
    timing only (the weights' layout picks f16x2 in the engine)."""
    from atom_core.kernels.triton import w4a16, w4a16_gemv_f16x2

    program = {"f16x2": w4a16_gemv_f16x2._w4a16_gemv_f16x2_tuned, "triton": w4a16._w4a16_gemv_tuned}[kind]
    saved = w4a16._tuned_gemv
    w4a16._tuned_gemv = lambda dtype, consts: program
    try:
        err = _rel(w4(0), ref)  # also the autotuning, before any graph capture
        return per_copy(lambda i: w4(i)), err
    finally:
        w4a16._tuned_gemv = saved


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


if __name__ == "__main__":
    main()
