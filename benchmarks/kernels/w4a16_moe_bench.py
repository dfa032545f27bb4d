"""Micro-benchmark (CUDA): the W4A16 fused MoE (`moe_w4a16.fused_moe_w4a16`, symmetric int4 experts)
on Qwen3-30B-A3B and DeepSeek-V3 expert shapes at M = 1 to 256 tokens, against the bytes-read floor
(packed int4 weights + bf16 group scales of the touched experts, plus the activations, at 3.0 TB/s)
and against the bf16 fused MoE on the same weights dequantized. Routing, timing and the table as in
`fp8_moe_bench`. Written in a session without a GPU: not run yet.

    python -m benchmarks.kernels.w4a16_moe_bench [--group 128] [--shapes qwen3-30b-a3b,deepseek-v3]
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.kernels.fp8_moe_bench import READ_BYTES_PER_S, SHAPES, TOKENS, _route, _time_us

GROUPS = (32, 64, 128)


def _experts(num_experts: int, rows: int, cols: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random int4 words [E, R, C/8] and bf16 scales [E, R, C/G] making unit-size dot products."""
    gen = torch.Generator(device="cuda").manual_seed(rows + cols)
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (num_experts, rows, cols // 8), dtype=torch.int32, device="cuda",
                          generator=gen)
    scales = (torch.rand(num_experts, rows, cols // group, device="cuda", generator=gen) + 0.5) / (4 * cols ** 0.5)
    return words, scales.bfloat16()


def _floor_bytes(num_experts: int, hidden: int, inter: int, top_k: int, num_tokens: int, group: int) -> int:
    touched = min(num_experts, num_tokens * top_k)
    per_expert = 3 * hidden * inter // 2 + 2 * 3 * hidden * inter // group
    return touched * per_expert + 2 * num_tokens * hidden * 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", type=int, default=128, help=f"int4 group size, one of {GROUPS}")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from: {', '.join(SHAPES)}")
    opts = parser.parse_args()
    names = opts.shapes.split(",")
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown shape(s) {unknown}; expected some of: {', '.join(SHAPES)}")
    if opts.group not in GROUPS:
        raise SystemExit(f"--group {opts.group}: expected one of {GROUPS}")
    if not torch.cuda.is_available():
        raise SystemExit("w4a16_moe_bench needs a CUDA GPU")
    from atom_core.kernels.triton.moe import fused_moe
    from atom_core.kernels.triton.moe_w4a16 import fused_moe_w4a16
    from atom_core.quant.int4_moe import dequantize_experts, fused_moe_w4a16_ref

    g = opts.group
    print(f"{torch.cuda.get_device_name()}; median us of CUDA-graph replays; group {g}, symmetric; floor = bytes of "
          f"the touched experts (int4 words, bf16 scales) and activations at {READ_BYTES_PER_S / 1e12:.1f} TB/s; "
          f"bf16 = moe.fused_moe on the dequantized weights; err = relative L2 error vs the reference")
    print(f"{'case':>14} {'M':>4} {'experts':>7} {'MB':>7} {'floor us':>8} {'w4 us':>8} {'x floor':>7} "
          f"{'bf16 us':>8} {'w4/bf16':>8} {'err':>8}")
    for name in names:
        e, h, i, k = SHAPES[name]
        w13, s13 = _experts(e, 2 * i, h, g)
        w2, s2 = _experts(e, h, i, g)
        w13_d, w2_d = dequantize_experts(w13, s13, None, g), dequantize_experts(w2, s2, None, g)
        for m in TOKENS:
            x = torch.randn(m, h, device="cuda").bfloat16()
            weights, ids = _route(e, k, m)
            args = (x, w13, s13, None, w2, s2, None, weights, ids, g)
            ref = fused_moe_w4a16_ref(*args).float()
            err = ((fused_moe_w4a16(*args).float() - ref).norm() / ref.norm()).item()
            t_w4 = _time_us(lambda: fused_moe_w4a16(*args))
            t_bf16 = _time_us(lambda: fused_moe(x, w13_d, w2_d, weights, ids))
            nbytes = _floor_bytes(e, h, i, k, m, g)
            floor = nbytes / READ_BYTES_PER_S * 1e6
            print(f"{name:>14} {m:>4} {min(e, m * k):>7} {nbytes / 1e6:7.1f} {floor:8.1f} {t_w4:8.1f} "
                  f"{t_w4 / floor:7.2f} {t_bf16:8.1f} {t_w4 / t_bf16:8.2f} {err:8.1e}", flush=True)
        w13 = w2 = w13_d = w2_d = None  # free this shape's experts before the next
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
