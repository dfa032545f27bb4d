"""Micro-benchmark (CUDA): the unquantized fused MoE's two decode paths (`moe.launch_fused_moe`
path="gemv": the GEMVs of moe_decode; path="tiled": alignment + tl.dot GEMMs + sum) on bf16 expert
shapes at M = 1, 2, 4, 8 tokens, against the bytes-read floor (weights and biases of the experts the
tokens touch, at 3.0 TB/s: the H100 read rate in DESIGN.md). Routing is fixed and spread (token t,
slot k -> expert (t*K + k) mod E), so the touched experts are min(E, M*K) and the floor is known.
Times are medians of CUDA-graph replays (the same weights every replay; every case's touched experts
are over 50 MB, the H100's L2). `auto` says what `select_path` picks
(the GEMVs for decode batches). `--sweep` times GEMV tiles (GEMM1's with GEMM2 at its default, then GEMM2's)
at the smallest and largest M and prints the best (to set moe_decode.DEFAULT_TILES).

    python -m benchmarks.kernels.moe_decode_bench [--shapes qwen3-30b-a3b,...] [--m 1,2,4,8] [--sweep]
"""
from __future__ import annotations

import argparse
from dataclasses import replace

import torch

# name -> (E, H, I, top_k, activation, swiglu_limit, biases): the released configs' experts in bf16
SHAPES = {
    "qwen3-30b-a3b": (128, 2048, 768, 8, "silu", None, False),
    "deepseek-v2-lite": (64, 2048, 1408, 6, "silu", None, False),
    "mixtral-8x7b": (8, 4096, 14336, 2, "silu", None, False),
    "gpt-oss-20b-bf16": (32, 2880, 2880, 4, "swigluoai", 7.0, True),
}
TOKENS = (1, 2, 4, 8)
READ_BYTES_PER_S = 3.0e12
GEMV1_SWEEP = [(4, 128, 1), (8, 128, 2), (8, 256, 4), (16, 128, 4), (8, 64, 1), (16, 256, 8), (4, 256, 2)]
GEMV2_SWEEP = [(2, 256), (4, 256), (8, 256), (4, 128), (8, 128), (2, 512)]


def _time_us(fn) -> float:
    from benchmarks.kernels.bench_kernels import bench_ms

    return bench_ms(fn) * 1000


def make_case(num_experts: int, hidden: int, inter: int, top_k: int, num_tokens: int, biases: bool) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, device="cuda", generator=gen)  # noqa: E731
    flat = torch.arange(num_tokens * top_k, device="cuda") % num_experts
    return dict(hidden=randn(num_tokens, hidden).bfloat16(),
                w13=(randn(num_experts, 2 * inter, hidden) * hidden ** -0.5).bfloat16(),
                w2=(randn(num_experts, hidden, inter) * inter ** -0.5).bfloat16(),
                topk_weights=torch.full((num_tokens, top_k), 1.0 / top_k, device="cuda"),
                topk_ids=flat.view(num_tokens, top_k).to(torch.int32),
                w13_bias=randn(num_experts, 2 * inter).bfloat16() * 0.1 if biases else None,
                w2_bias=randn(num_experts, hidden).bfloat16() * 0.1 if biases else None)


def floor_bytes(num_experts: int, hidden: int, inter: int, top_k: int, num_tokens: int, biases: bool) -> int:
    """bf16 bytes of the touched experts (w13, w2, biases) plus the activations in and out."""
    per_expert = 3 * hidden * inter * 2 + ((2 * inter + hidden) * 2 if biases else 0)
    return min(num_experts, num_tokens * top_k) * per_expert + 2 * num_tokens * hidden * 2


def _sweep(case: dict, activation: str, limit: float | None, name: str, m: int) -> None:
    from atom_core.kernels.triton import moe_decode

    def run(tiles):
        out = torch.empty_like(case["hidden"])
        return lambda: moe_decode.fused_moe_gemv(case["hidden"], case["w13"], case["w2"], case["topk_weights"],
                                                 case["topk_ids"], activation, case["w13_bias"], case["w2_bias"],
                                                 limit, out, tiles)

    base = moe_decode.DEFAULT_TILES
    for label, sweep in (("gemv1", GEMV1_SWEEP), ("gemv2", GEMV2_SWEEP)):
        tiles = [getattr(base, label)] + [t for t in sweep if t != getattr(base, label)]
        timed = sorted((_time_us(run(replace(base, **{label: t}))), t) for t in tiles)
        default = next(us for us, tile in timed if tile == getattr(base, label))
        best = "; ".join(f"{tile} {us:.1f}" for us, tile in timed[:3])
        print(f"{'':>17} sweep {name} M={m} {label}: default {getattr(base, label)} {default:.1f} us; best: {best}",
              flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of: {', '.join(SHAPES)}")
    parser.add_argument("--m", default=",".join(map(str, TOKENS)), help="token counts, comma-separated")
    parser.add_argument("--sweep", action="store_true", help="also time GEMV tiles at the smallest and largest M")
    opts = parser.parse_args(argv)
    shapes = [s for s in opts.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shape {unknown[0]!r}; expected one of: {', '.join(SHAPES)}")
    try:
        tokens = sorted({int(m) for m in opts.m.split(",") if m})
    except ValueError:
        parser.error(f"--m takes positive integers, got {opts.m!r}")
    if not tokens or tokens[0] < 1:
        parser.error(f"--m takes positive integers, got {opts.m!r}")
    if not torch.cuda.is_available():
        raise SystemExit("moe_decode_bench needs a CUDA GPU")
    from atom_core.kernels import moe_ref
    from atom_core.kernels.triton.moe import launch_fused_moe
    from atom_core.kernels.triton.moe_decode import GEMV_MAX_ASSIGNMENTS, GEMV_MAX_TOKENS, select_path

    print(f"{torch.cuda.get_device_name()}; median us of CUDA-graph replays; floor = bf16 bytes of the touched experts "
          f"at {READ_BYTES_PER_S / 1e12:.1f} TB/s; gemv / tiled = launch_fused_moe's two paths; auto = the path "
          f"select_path picks (gemv up to M = {GEMV_MAX_TOKENS} and M*K = {GEMV_MAX_ASSIGNMENTS}); "
          f"err = relative L2 error vs moe_ref.fused_moe")
    print(f"{'case':>17} {'M':>3} {'M*K':>4} {'experts':>7} {'MB':>7} {'floor us':>8} {'gemv us':>8} {'x floor':>7} "
          f"{'tiled us':>8} {'x floor':>7} {'auto':>5} {'gemv err':>8} {'tiled err':>9}")
    for name in shapes:
        e, h, i, k, activation, limit, biases = SHAPES[name]
        for m in tokens:
            case = make_case(e, h, i, k, m, biases)
            run = lambda path, c=case: launch_fused_moe(**c, activation=activation, swiglu_limit=limit,  # noqa: E731
                                                        path=path)
            ref = moe_ref.fused_moe(**case, activation=activation, swiglu_limit=limit).float()
            errs = [((run(p).float() - ref).norm() / ref.norm()).item() for p in ("gemv", "tiled")]
            t_gemv, t_tiled = _time_us(lambda: run("gemv")), _time_us(lambda: run("tiled"))
            nbytes = floor_bytes(e, h, i, k, m, biases)
            floor = nbytes / READ_BYTES_PER_S * 1e6
            print(f"{name:>17} {m:>3} {m * k:>4} {min(e, m * k):>7} {nbytes / 1e6:7.1f} {floor:8.1f} {t_gemv:8.1f} "
                  f"{t_gemv / floor:7.2f} {t_tiled:8.1f} {t_tiled / floor:7.2f} {select_path(m, k):>5} "
                  f"{errs[0]:8.1e} {errs[1]:9.1e}", flush=True)
            if opts.sweep and m in (tokens[0], tokens[-1]):
                _sweep(case, activation, limit, name, m)
            del case


if __name__ == "__main__":
    main()
