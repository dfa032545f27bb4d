"""Micro-benchmark (CUDA): dense FP8 linears on Llama-3-8B and DeepSeek-V3 projection shapes at M
tokens (default 1 and 32), CUDA-graph medians in us, against the bytes-read floor at 3.0 TB/s
(e4m3 weights + their float32 scales; activations are noise at these M):

  bf16         F.linear on a bf16 weight of the shape (what FP8 must beat)
  scaled_mm    fp8_linear's CUDA path above 32 tokens: Triton per-token quantizer + torch._scaled_mm
               row-wise (fp8_ops.fp8_scaled_mm)
  tr-channel   the Triton GEMM, per-channel scales (fp8_channel_gemm; what fp8_linear runs for shapes
               _scaled_mm refuses)
  tr-block     the Triton GEMM, row-expanded 128x128 block scales (fp8_block_gemm: block-FP8
               checkpoints, the CUDA default of fp8_block_linear)
  quant        the per-token quantizer alone (the launch the Triton small-M path fuses away)
  gemv ch/blk  the weight-only FP8 GEMV (kernels/triton/fp8_gemv.py, x not quantized), per-channel
               and row-expanded block scales; M <= 4 only (blank above; the linears take it at 1 token)
  w8a16        the weight-only FP8 GEMM (kernels/triton/fp8_w8a16.py), per-channel, 2 <= M <= 64
               (blank elsewhere; the linears take it at 2-32 tokens, fp8_ops.fp8_linear_table)

`--sweep` times a few small-M tiles (BLOCK_N x split-K x stages) per shape for both Triton kinds;
`--sweep-w8a16` the weight-only GEMM's (BLOCK_N x BLOCK_K x stages, split by the grid) at 2 <= M <= 64;
`--sweep-gemv` the GEMV's (BLOCK_K x weights a thread x split-K) at M <= 4.
Weight values do not affect speed (random e4m3). Results: docs/PERFORMANCE.md (H100, 2026-11-26).
`python -m benchmarks.kernels.fp8_bench [--shapes llama-3-8b,deepseek-v3,qwen3-30b-a3b] [--m 1,32]
[--sweep | --sweep-gemv]`. Issue 16 (Qwen3-30B-A3B-FP8 batch 1): `--shapes qwen3-30b-a3b --m 1,2`, where
tr-block is the block GEMM, gemv blk the block GEMV (what block-FP8 linears run at 1 token), bf16 the baseline.
"""
from __future__ import annotations

import argparse
from dataclasses import replace

import torch

# model -> projection -> (N, K), one GPU (TP 1)
SHAPES = {
    "llama-3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    # MLA projections (q_a, kv_a with the rope dims, q_b over 128 heads of 192, o) and the dense MLP of
    # the first three layers
    "deepseek-v3": {"q_a": (1536, 7168), "kv_a": (576, 7168), "q_b": (24576, 1536), "o": (7168, 16384),
                    "gate_up": (36864, 7168), "down": (7168, 18432)},
    # attention of Qwen3-30B-A3B (32 q + 4 kv heads of 128, hidden 2048); its experts: fp8_moe_bench
    "qwen3-30b-a3b": {"qkv": (5120, 2048), "o": (2048, 4096)},
}
# the scale layouts each model's checkpoints come in (DeepSeek-V3 ships block FP8 only); the group is bk
SWEEP_KINDS = {"llama-3-8b": (("channel", None), ("block", 128)), "deepseek-v3": (("block", 128),),
               "qwen3-30b-a3b": (("block", 128),)}
FLOOR_BYTES_PER_S = 3.0e12


def _time_us(fn) -> float:
    """Median of CUDA-graph replays (launch overhead as in a captured decode step)."""
    from benchmarks.kernels.bench_kernels import bench_ms

    return bench_ms(fn) * 1000


def floor_us(n: int, k: int, block: bool) -> float:
    scale_bytes = n * -(-k // 128) * 4 if block else n * 4
    return (n * k + scale_bytes) / FLOOR_BYTES_PER_S * 1e6


def _weights(n: int, k: int):
    """e4m3 [N, K], per-channel scales [N, 1] and row-expanded block scales [N, ceil(K/128)]."""
    w = (torch.randn(n, k, device="cuda") * 32).to(torch.float8_e4m3fn)
    return w, torch.full((n, 1), 1e-3, device="cuda"), torch.full((n, -(-k // 128)), 1e-3, device="cuda")


def _table(names: list[str], ms: list[int]) -> None:
    from atom_core.kernels.triton.fp8 import quantize_fp8_per_token
    from atom_core.kernels.triton.fp8_gemm import fp8_block_gemm, fp8_channel_gemm
    from atom_core.kernels.triton.fp8_gemv import fp8_block_gemv, fp8_channel_gemv
    from atom_core.kernels.triton.fp8_w8a16 import W8A16_MAX_TOKENS, fp8_w8a16_gemm
    from atom_core.quant.fp8_ops import GEMV_MAX_TOKENS, fp8_scaled_mm

    cols = ("bf16", "scaled_mm", "tr-channel", "tr-block", "quant", "gemv ch", "gemv blk", "w8a16", "floor ch",
            "floor blk")
    print(f"{'model':>12} {'shape':>8} {'M':>4} " + " ".join(f"{c:>10}" for c in cols))
    for model in names:
        for name, (n, k) in SHAPES[model].items():
            w, s_channel, s_block = _weights(n, k)
            wb = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                times = [_time_us(lambda: torch.nn.functional.linear(x, wb)),
                         _time_us(lambda: fp8_scaled_mm(x, w, s_channel, None, None)),
                         _time_us(lambda: fp8_channel_gemm(x, w, s_channel)),
                         _time_us(lambda: fp8_block_gemm(x, w, s_block, [1, 128])),
                         _time_us(lambda: quantize_fp8_per_token(x))]
                if m <= GEMV_MAX_TOKENS:
                    times += [_time_us(lambda: fp8_channel_gemv(x, w, s_channel)),
                              _time_us(lambda: fp8_block_gemv(x, w, s_block, [1, 128]))]
                else:
                    times += [None, None]
                times += [_time_us(lambda: fp8_w8a16_gemm(x, w, s_channel)) if 2 <= m <= W8A16_MAX_TOKENS else None]
                times += [floor_us(n, k, False), floor_us(n, k, True)]
                print(f"{model:>12} {name:>8} {m:>4} " + " ".join(" " * 10 if t is None else f"{t:10.1f}" for t in times),
                      flush=True)


def _sweep(names: list[str], ms: list[int]) -> None:
    """A few tiles around the default per (shape, M <= 16): the next default comes from here."""
    from atom_core.kernels.triton.common import sm_count
    from atom_core.kernels.triton.fp8_gemm import default_fp8_gemm_config, fp8_block_gemm, fp8_channel_gemm

    print(f"{'model':>12} {'shape':>8} {'M':>4} {'kind':>8} {'BN':>4} {'split':>5} {'stages':>6} {'us':>8} {'floor':>8}")
    for model in names:
        for name, (n, k) in SHAPES[model].items():
            w, s_channel, s_block = _weights(n, k)
            for m in (m for m in ms if m <= 16):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                for kind, group in SWEEP_KINDS[model]:
                    base = default_fp8_gemm_config(m, n, k, group, sm_count(x.device))
                    for bn in (32, 64, 128):
                        for split in sorted({max(1, base.split_k // 2), base.split_k, base.split_k * 2}):
                            for stages in (3, 5):
                                cfg = replace(base, block_n=bn, split_k=split, num_stages=stages)
                                if kind == "block":
                                    t = _time_us(lambda: fp8_block_gemm(x, w, s_block, [1, 128], config=cfg))
                                else:
                                    t = _time_us(lambda: fp8_channel_gemm(x, w, s_channel, config=cfg))
                                print(f"{model:>12} {name:>8} {m:>4} {kind:>8} {bn:>4} {split:>5} {stages:>6} "
                                      f"{t:8.1f} {floor_us(n, k, kind == 'block'):8.1f}", flush=True)


def _sweep_gemv(names: list[str], ms: list[int]) -> None:
    """The GEMV's tiles around the default per (shape, M <= 4): BLOCK_K x weights a thread a step x split-K."""
    from atom_core.kernels.triton.common import sm_count
    from atom_core.kernels.triton.fp8_gemv import default_fp8_gemv_config, fp8_block_gemv, fp8_channel_gemv
    from atom_core.quant.fp8_ops import GEMV_MAX_TOKENS

    print(f"{'model':>12} {'shape':>8} {'M':>4} {'kind':>8} {'BK':>5} {'BN':>4} {'split':>5} {'us':>8} {'floor':>8}")
    for model in names:
        for name, (n, k) in SHAPES[model].items():
            w, s_channel, s_block = _weights(n, k)
            for m in (m for m in ms if m <= GEMV_MAX_TOKENS):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                for kind, group in SWEEP_KINDS[model]:
                    base = default_fp8_gemv_config(m, n, k, 2, group, sm_count(x.device))
                    # 2048 with 16 a thread: one weight row a program in 16-byte loads, the tile the
                    # bf16 GEMV's sweep found fastest (docs/PERFORMANCE.md 2026-11-26, fifth session)
                    for bk in (256, 512, 1024, 2048):
                        for per_thread in (16, 32):
                            bn = max(1, per_thread * 32 * base.num_warps // bk)
                            for split in sorted({1, base.split_k, 2}):
                                cfg = replace(base, block_n=bn, block_k=bk, split_k=split)
                                if kind == "block":
                                    t = _time_us(lambda: fp8_block_gemv(x, w, s_block, [1, 128], config=cfg))
                                else:
                                    t = _time_us(lambda: fp8_channel_gemv(x, w, s_channel, config=cfg))
                                print(f"{model:>12} {name:>8} {m:>4} {kind:>8} {bk:>5} {bn:>4} {split:>5} "
                                      f"{t:8.1f} {floor_us(n, k, kind == 'block'):8.1f}", flush=True)


def _sweep_w8a16(names: list[str], ms: list[int]) -> None:
    """The weight-only GEMM's tiles per (shape, 2 <= M <= 64): BLOCK_N x BLOCK_K x stages, 4 warps."""
    import triton

    from atom_core.kernels.triton.fp8_w8a16 import W8A16_MAX_TOKENS, default_tiles, fp8_w8a16_gemm

    print(f"{'model':>12} {'shape':>8} {'M':>4} {'BN':>4} {'BK':>4} {'stages':>6} {'us':>8} {'floor':>8} default")
    for model in names:
        for name, (n, k) in SHAPES[model].items():
            w, s_channel, _ = _weights(n, k)
            for m in (m for m in ms if 2 <= m <= W8A16_MAX_TOKENS):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                _, dbn, dbk, _, _, dstages = default_tiles(m, n, k, 132, 2)
                for bn in (32, 64, 128):
                    for bk in (64, 128, 256):
                        for stages in (3, 4, 6):
                            try:
                                t = _time_us(lambda: fp8_w8a16_gemm(x, w, s_channel, tiles=(bn, bk, 4, stages)))
                            except triton.runtime.errors.OutOfResources:  # shared memory: this tile cannot run
                                continue
                            mark = "*" if (bn, bk, stages) == (dbn, dbk, dstages) else ""
                            print(f"{model:>12} {name:>8} {m:>4} {bn:>4} {bk:>4} {stages:>6} {t:8.1f} "
                                  f"{floor_us(n, k, False):8.1f} {mark}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from: {', '.join(SHAPES)}")
    parser.add_argument("--m", default="1,32", help="comma-separated token counts")
    parser.add_argument("--sweep", action="store_true", help="time small-M tiles (M <= 16) instead of the table")
    parser.add_argument("--sweep-gemv", action="store_true", help="time the FP8 GEMV's tiles (M <= 4) instead")
    parser.add_argument("--sweep-w8a16", action="store_true",
                        help="time the weight-only FP8 GEMM's tiles (2 <= M <= 64) instead")
    args = parser.parse_args()
    if args.sweep + args.sweep_gemv + args.sweep_w8a16 > 1:
        raise SystemExit("--sweep, --sweep-gemv and --sweep-w8a16 are separate runs; pass one")
    names = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in names if s not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown shape(s) {unknown}; expected some of: {', '.join(SHAPES)}")
    try:
        ms = [int(v) for v in args.m.split(",") if v]
    except ValueError:
        raise SystemExit(f"--m takes comma-separated positive integers, got {args.m!r}") from None
    if not ms or min(ms) < 1:
        raise SystemExit(f"--m takes comma-separated positive integers, got {args.m!r}")
    if not torch.cuda.is_available():
        raise SystemExit("fp8_bench needs a CUDA GPU")
    run = _sweep if args.sweep else _sweep_gemv if args.sweep_gemv else _sweep_w8a16 if args.sweep_w8a16 else _table
    run(names, ms)


if __name__ == "__main__":
    main()
