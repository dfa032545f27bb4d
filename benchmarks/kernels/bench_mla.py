"""MLA decode attention bandwidth on the latent cache (DeepSeek-V2-Lite shapes by default:
16 heads, latent 512 + rope 64, bf16), over a sweep of tile shapes and KV splits.

    python -m benchmarks.kernels.bench_mla --bs 64 --ctx 2048 [--heads 16] [--sweep] [--out f.json]

Bytes counted: the latent rows every sequence reads (bs x ctx x 576 x 2) plus q and out;
time: CUDA-graph replays of one launch (so launch overhead is not counted), median of 5 runs.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

from atom_core.kernels.triton.mla import launch_mla_attention

HBM_BYTES_PER_S = 3.0e12  # H100 measured read bandwidth (docs/PERFORMANCE.md)


def make_inputs(bs: int, ctx: int, heads: int, latent: int, rope: int, block_size: int = 16):
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = bs * blocks_per_seq
    gen = torch.Generator(device="cuda").manual_seed(0)
    cache = torch.randn(num_blocks, block_size, 1, latent + rope, device="cuda", generator=gen).bfloat16()
    tables = torch.randperm(num_blocks, device="cuda", generator=gen).int().view(bs, blocks_per_seq)
    q_latent = torch.randn(bs, heads, latent, device="cuda", generator=gen).bfloat16()
    q_rope = torch.randn(bs, heads, rope, device="cuda", generator=gen).bfloat16()
    qsl = torch.arange(bs + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((bs,), ctx, dtype=torch.int32, device="cuda")
    bytes_moved = bs * ctx * (latent + rope) * 2 + 2 * bs * heads * (latent + rope) * 2
    return (q_latent, q_rope, cache, tables, qsl, seq_lens, (192) ** -0.5, 1, ctx), bytes_moved


def time_graph(fn) -> float:
    """Seconds per call: median of CUDA-graph replays."""
    from benchmarks.kernels.bench_kernels import bench_ms

    return bench_ms(fn) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bs", type=int, default=64)
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    inputs, nbytes = make_inputs(args.bs, args.ctx, args.heads, 512, 64)
    out = torch.empty_like(inputs[0])
    configs = [dict()]  # the defaults first
    if args.sweep:
        configs += [dict(block_n=n, num_warps=w, num_stages=s, num_kv_splits=k)
                    for n, w, s, k in itertools.product([32, 64], [4, 8], [1, 2, 3], [1, 2, 4, 8])]
    rows = []
    for cfg in configs:
        try:
            sec = time_graph(lambda: launch_mla_attention(*inputs, out=out, **cfg))
        except Exception as e:  # noqa: BLE001 - a tile shape may not fit shared memory; report and go on
            print(f"{cfg}: failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            continue
        bw = nbytes / sec
        rows.append(dict(cfg=cfg or "default", us=sec * 1e6, tb_s=bw / 1e12, pct_hbm=100 * bw / HBM_BYTES_PER_S))
    rows.sort(key=lambda r: r["us"])
    print(f"MLA decode bs={args.bs} ctx={args.ctx} heads={args.heads}: latent bytes {nbytes / 1e6:.1f} MB")
    print(f"{'config':70s} {'us':>8s} {'TB/s':>6s} {'%HBM':>6s}")
    for r in rows[:12] + [r for r in rows if r["cfg"] == "default"]:
        print(f"{str(r['cfg']):70s} {r['us']:8.1f} {r['tb_s']:6.2f} {r['pct_hbm']:6.1f}")
    if args.out:
        json.dump(rows, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
