"""Micro-benchmark (CUDA): the block-FP8 fused MoE (`moe_fp8.fused_moe_fp8_block`) on Qwen3-30B-A3B-FP8
and DeepSeek-V3 expert shapes at M = 1 to 256 tokens, against the bytes-read floor (e4m3 weights +
row-expanded float32 scales of the experts the tokens touch, plus the activations, at 3.0 TB/s:
the H100 read rate in DESIGN.md) and against the bf16 fused MoE (`moe.fused_moe`) on the same
weights dequantized. Routing is fixed and spread (token t, slot k -> expert (t*K + k) mod E), so
the touched experts are min(E, M*K) and the floor is known. Times are medians of CUDA-graph replays.
`--sweep` also times a grid of tile configs at M = 1 and 32 and prints the best three (to set
`default_fp8_moe_config`). Written in a session without a GPU: not run yet.

    python -m benchmarks.kernels.fp8_moe_bench [--sweep] [--shapes qwen3-30b-a3b,deepseek-v3]
"""
from __future__ import annotations

import argparse
import itertools

import torch

from atom_core.kernels.triton.moe import GemmTile, MoeConfig

# name -> (E, H, I, top_k): the released configs
SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8), "deepseek-v3": (256, 7168, 2048, 8)}
TOKENS = (1, 4, 8, 16, 32, 64, 256)
SWEEP_TOKENS = (1, 32)
READ_BYTES_PER_S = 3.0e12
GROUP = 128


def _time_us(fn) -> float:
    from benchmarks.kernels.bench_kernels import bench_ms

    return bench_ms(fn) * 1000


def _experts(num_experts: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 [E, R, C] and row-expanded scales [E, R, ceil(C/G)] (one expert at a time: bounded memory)."""
    gen = torch.Generator(device="cuda").manual_seed(rows + cols)
    w = torch.empty(num_experts, rows, cols, dtype=torch.float8_e4m3fn, device="cuda")
    for e in range(num_experts):
        w[e] = (torch.randn(rows, cols, device="cuda", generator=gen) * 32).to(torch.float8_e4m3fn)
    blocks = torch.rand(num_experts, -(-rows // 128), -(-cols // GROUP), device="cuda", generator=gen) + 0.5
    return w, (blocks / (32 * cols ** 0.5)).repeat_interleave(128, 1)[:, :rows].contiguous()


def _dequantize(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out = torch.empty(w.shape, dtype=torch.bfloat16, device=w.device)
    for e in range(w.shape[0]):
        out[e] = (w[e].float() * scale[e].repeat_interleave(GROUP, 1)[:, :w.shape[2]]).bfloat16()
    return out


def _route(num_experts: int, top_k: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    flat = torch.arange(num_tokens * top_k, device="cuda") % num_experts
    return torch.full((num_tokens, top_k), 1.0 / top_k, device="cuda"), flat.view(num_tokens, top_k).to(torch.int32)


def _floor_bytes(num_experts: int, hidden: int, inter: int, top_k: int, num_tokens: int) -> int:
    touched = min(num_experts, num_tokens * top_k)
    groups = lambda k: -(-k // GROUP)  # noqa: E731
    per_expert = 3 * hidden * inter + 4 * (2 * inter * groups(hidden) + hidden * groups(inter))
    return touched * per_expert + 2 * num_tokens * hidden * 2


def _sweep_configs() -> list[MoeConfig]:
    tiles = [GemmTile(n, GROUP, 1, 4, s) for n, s in itertools.product((32, 64, 128), (3, 4, 5))]
    tiles += [GemmTile(n, GROUP, 1, 2, 4) for n in (32, 64)]
    return [MoeConfig(bm, t, t) for bm in (16, 32) for t in tiles]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time a grid of tile configs at M = 1 and 32")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from: {', '.join(SHAPES)}")
    opts = parser.parse_args()
    names = opts.shapes.split(",")
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown shape(s) {unknown}; expected some of: {', '.join(SHAPES)}")
    if not torch.cuda.is_available():
        raise SystemExit("fp8_moe_bench needs a CUDA GPU")
    from atom_core.kernels.triton.moe import fused_moe
    from atom_core.kernels.triton.moe_fp8 import default_fp8_moe_config, fused_moe_fp8_block
    from atom_core.quant.fp8 import fused_moe_fp8_block_ref

    print(f"{torch.cuda.get_device_name()}; median us of CUDA-graph replays; floor = bytes of the touched experts "
          f"(e4m3 weights, row-expanded float32 scales) and activations at {READ_BYTES_PER_S / 1e12:.1f} TB/s; "
          f"bf16 = moe.fused_moe on the dequantized weights; err = relative L2 error vs the reference")
    print(f"{'case':>14} {'M':>4} {'experts':>7} {'MB':>7} {'floor us':>8} {'fp8 us':>8} {'x floor':>7} "
          f"{'bf16 us':>8} {'fp8/bf16':>8} {'err':>8}")
    for name in names:
        e, h, i, k = SHAPES[name]
        w13, s13 = _experts(e, 2 * i, h)
        w2, s2 = _experts(e, h, i)
        w13_d, w2_d = _dequantize(w13, s13), _dequantize(w2, s2)
        for m in TOKENS:
            x = torch.randn(m, h, device="cuda").bfloat16()
            weights, ids = _route(e, k, m)
            args = (x, w13, s13, w2, s2, weights, ids)
            run = lambda cfg=None: fused_moe_fp8_block(*args, config=cfg)  # noqa: E731
            ref = fused_moe_fp8_block_ref(*args).float()
            err = ((run().float() - ref).norm() / ref.norm()).item()
            t_fp8 = _time_us(run)
            t_bf16 = _time_us(lambda: fused_moe(x, w13_d, w2_d, weights, ids))
            nbytes = _floor_bytes(e, h, i, k, m)
            floor = nbytes / READ_BYTES_PER_S * 1e6
            print(f"{name:>14} {m:>4} {min(e, m * k):>7} {nbytes / 1e6:7.1f} {floor:8.1f} {t_fp8:8.1f} "
                  f"{t_fp8 / floor:7.2f} {t_bf16:8.1f} {t_fp8 / t_bf16:8.2f} {err:8.1e}", flush=True)
            if opts.sweep and m in SWEEP_TOKENS:
                timed = sorted(((_time_us(lambda c=c: run(c)), c) for c in _sweep_configs()), key=lambda p: p[0])
                print(f"{'':>14} sweep: default {default_fp8_moe_config(m, k, e, GROUP)} {t_fp8:.1f} us; best 3:")
                for t, c in timed[:3]:
                    print(f"{'':>14}   {t:8.1f} us  {c}", flush=True)
        w13 = w2 = w13_d = w2_d = None  # free this shape's experts before the next
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
