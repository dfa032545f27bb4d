"""Micro-benchmark (CUDA): the MXFP4 fused MoE (`moe_mxfp4.fused_moe_mxfp4`) on GPT-OSS shapes at
M = 1, 4, 8, 16, 32 tokens, both its paths (the decode GEMVs of moe_mxfp4_decode, which `auto`
picks for M * top_k <= 32, and the tiled tl.dot kernels), against the bytes-read floor (packed
weights + scales + biases of the experts the tokens touch, at 3.0 TB/s: the H100 read rate in
DESIGN.md) and against the bf16 fused MoE (`moe.fused_moe`) on the same weights dequantized.
Routing is fixed and spread (token t, slot k -> expert (t*K + k) mod E), so the touched experts are
min(E, M*K) and the floor is known. Times are medians of CUDA-graph replays (the same weights every
replay: a working set under the 50 MB L2 would flatter the times; gpt-oss's 4 experts are ~53 MB).
`--sweep` also times a grid of tile configs of the tiled path at M = 1 and 32 and prints the best
(to set `default_mxfp4_config`).

    python -m benchmarks.kernels.mxfp4_bench [--sweep]
"""
from __future__ import annotations

import argparse
import itertools

import torch

from atom_core.kernels.triton.moe import GemmTile, MoeConfig

# name -> (E, H, I, top_k): the released configs
SHAPES = {"gpt-oss-20b": (32, 2880, 2880, 4), "gpt-oss-120b": (128, 2880, 2880, 4)}
TOKENS = (1, 4, 8, 16, 32)
SWEEP_TOKENS = (1, 32)
READ_BYTES_PER_S = 3.0e12


def _time_us(fn) -> float:
    from benchmarks.kernels.bench_kernels import bench_ms

    return bench_ms(fn) * 1000


def _case(num_experts: int, hidden: int, inter: int, top_k: int, num_tokens: int):
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randint(0, 256, (num_experts, 2 * inter, hidden // 2), dtype=torch.uint8, device="cuda", generator=gen)
    w2 = torch.randint(0, 256, (num_experts, hidden, inter // 2), dtype=torch.uint8, device="cuda", generator=gen)
    s13 = torch.randint(118, 122, (num_experts, 2 * inter, hidden // 32), dtype=torch.uint8, device="cuda",
                        generator=gen)
    s2 = torch.randint(118, 122, (num_experts, hidden, inter // 32), dtype=torch.uint8, device="cuda", generator=gen)
    b13 = torch.randn(num_experts, 2 * inter, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.1
    b2 = torch.randn(num_experts, hidden, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.1
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    flat = torch.arange(num_tokens * top_k, device="cuda") % num_experts
    ids = flat.view(num_tokens, top_k).to(torch.int32)
    weights = torch.full((num_tokens, top_k), 1.0 / top_k, device="cuda")
    return (x, w13, s13, w2, s2, weights, ids), b13, b2


def _floor_bytes(num_experts: int, hidden: int, inter: int, top_k: int, num_tokens: int) -> int:
    touched = min(num_experts, num_tokens * top_k)
    per_expert = 3 * hidden * inter // 2 + 3 * hidden * inter // 32 + (2 * inter + hidden) * 2
    return touched * per_expert + 2 * num_tokens * hidden * 2


def _sweep_configs() -> list[MoeConfig]:
    tiles = [GemmTile(n, k, 1, 4, s) for n, k, s in itertools.product((16, 32, 64), (128, 256), (3, 4))]
    tiles += [GemmTile(32, 128, 1, 2, 3), GemmTile(64, 128, 1, 8, 3)]
    return [MoeConfig(16, t, t) for t in tiles]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time a grid of tile configs per case")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("mxfp4_bench needs a CUDA GPU")
    from atom_core.kernels.triton.moe import fused_moe
    from atom_core.kernels.triton.moe_mxfp4 import default_mxfp4_config, fused_moe_mxfp4, select_path
    from atom_core.kernels.triton.moe_mxfp4_decode import GEMV_MAX_ASSIGNMENTS
    from atom_core.quant.mxfp4 import dequantize_mxfp4, fused_moe_mxfp4_ref

    print(f"{torch.cuda.get_device_name()}; median us of CUDA-graph replays; floor = bytes of the touched experts "
          f"(packed weights, scales, biases) at {READ_BYTES_PER_S / 1e12:.1f} TB/s; gemv / tiled = the two paths of "
          f"fused_moe_mxfp4 (auto picks gemv up to M*K = {GEMV_MAX_ASSIGNMENTS}); bf16 = moe.fused_moe on the "
          f"dequantized weights; activation swigluoai, biases on; err = relative L2 error vs the reference")
    print(f"{'case':>13} {'M':>4} {'experts':>7} {'MB':>7} {'floor us':>8} {'gemv us':>8} {'x floor':>7} "
          f"{'tiled us':>8} {'x floor':>7} {'auto':>5} {'bf16 us':>8} {'gemv err':>8} {'tiled err':>9}")
    for name, (e, h, i, k) in SHAPES.items():
        w13_d = w2_d = None
        for m in TOKENS:
            args, b13, b2 = _case(e, h, i, k, m)
            run = lambda cfg=None, path="auto": fused_moe_mxfp4(  # noqa: E731
                *args, "swigluoai", b13, b2, 7.0, config=cfg, path=path)
            ref = fused_moe_mxfp4_ref(*args, "swigluoai", b13, b2, 7.0).float()
            errs = [((run(path=p).float() - ref).norm() / ref.norm()).item() for p in ("gemv", "tiled")]
            t_gemv = _time_us(lambda: run(path="gemv"))
            t_tiled = _time_us(lambda: run(path="tiled"))
            if w13_d is None:  # the dequantized experts, once per shape
                w13_d = dequantize_mxfp4(args[1], args[2], torch.bfloat16)
                w2_d = dequantize_mxfp4(args[3], args[4], torch.bfloat16)
            t_bf16 = _time_us(lambda: fused_moe(args[0], w13_d, w2_d, args[5], args[6], "swigluoai", b13, b2, 7.0))
            nbytes = _floor_bytes(e, h, i, k, m)
            floor = nbytes / READ_BYTES_PER_S * 1e6
            print(f"{name:>13} {m:>4} {min(e, m * k):>7} {nbytes / 1e6:7.1f} {floor:8.1f} {t_gemv:8.1f} "
                  f"{t_gemv / floor:7.2f} {t_tiled:8.1f} {t_tiled / floor:7.2f} {select_path(m, k):>5} {t_bf16:8.1f} "
                  f"{errs[0]:8.1e} {errs[1]:9.1e}", flush=True)
            if opts.sweep and m in SWEEP_TOKENS:
                timed = sorted((_time_us(lambda c=c: run(c)), c) for c in _sweep_configs())
                default = default_mxfp4_config(m, k, e)
                print(f"{'':>13} sweep (tiled): default {default} {t_tiled:.1f} us; best 3:")
                for t, c in timed[:3]:
                    print(f"{'':>13}   {t:8.1f} us  {c}", flush=True)
        del w13_d, w2_d


if __name__ == "__main__":
    main()
