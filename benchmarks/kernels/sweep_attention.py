"""Decode paged-attention schedule sweep on the GPU: KV splits x sequence order per batch size.

Diagnostic, not a test: `python -m benchmarks.kernels.sweep_attention` prints one line per shape with
the time of each choice and the best one's KV bandwidth (against the ~3.0 TB/s HBM ceiling).
(The tile sweep of the first probe run, docs/PERFORMANCE.md, found BLOCK_N/warps/stages flat.)
"""
from __future__ import annotations

import argparse
import random

import torch
import triton
import triton.testing

from atom_core.kernels.triton import attention as A



def make_inputs(heads, kv_heads, head_dim, batch, block_size=16, lo=100, hi=1600, seed=0):
    rng = random.Random(seed)
    lens = [rng.randint(lo, hi) for _ in range(batch)]
    per_seq = triton.cdiv(max(lens), block_size)
    num_blocks = batch * per_seq
    perm = torch.randperm(num_blocks, device="cuda", dtype=torch.int32)  # scattered blocks, like a used cache
    tables = perm.view(batch, per_seq).contiguous()
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    seq_lens = torch.tensor(lens, device="cuda", dtype=torch.int32)
    kv_bytes = sum(lens) * kv_heads * head_dim * 2 * 2
    return q, k, v, tables, qsl, seq_lens, max(lens), kv_bytes


def timed(fn, repeats=3) -> float:
    """Median of `repeats` do_bench medians (single runs showed 2x outliers), in ms."""
    return sorted(triton.testing.do_bench(fn, warmup=20, rep=60) for _ in range(repeats))[repeats // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="8,16,32,48,64,96,128,256")
    ap.add_argument("--lo", type=int, default=100, help="shortest context (uniform in [lo, hi])")
    ap.add_argument("--hi", type=int, default=1600)
    ap.add_argument("--splits", default="1,2", help="KV split counts to time")
    ap.add_argument("--heads", default="32/8", help="with --tiles: query / KV heads pairs, e.g. 32/8,16/8")
    ap.add_argument("--tiles", default="",
                    help="instead: decode tiles BLOCK_NxSTAGESxWARPS,... at the heuristic's splits")
    args = ap.parse_args()
    if args.tiles:
        return sweep_tiles(args)
    print(f"decode attention, one layer, contexts {args.lo}-{args.hi}: us per launch (median of 3) for KV splits "
          f"{args.splits}, plain order / "
          "longest first / longest first with a sequence's kv heads adjacent; the heuristic's split count in []")
    for heads, kv_heads in ((16, 8), (32, 8)):
        for batch in map(int, args.batches.split(",")):
            q, k, v, tables, qsl, seq_lens, max_len, kv_bytes = make_inputs(heads, kv_heads, 128, batch, lo=args.lo,
                                                                             hi=args.hi)
            out = torch.empty_like(q)
            chosen = A.choose_num_kv_splits(batch * kv_heads, max_len, q.device, batch * heads * 129 * 4)
            order = torch.argsort(seq_lens, descending=True).to(torch.int32)
            ref = A.launch_paged_attention(q, k, v, tables, qsl, seq_lens, 0.088, 1, max_len, num_kv_splits=1)
            cells, best = [], (1e9, "")
            for splits in map(int, args.splits.split(",")):
                pair = []
                for name, seq_order, inner in (("plain", None, False), ("longest", order, False),
                                               ("longest+heads-inner", order, True)):
                    run = lambda: A.launch_paged_attention(  # noqa: E731
                        q, k, v, tables, qsl, seq_lens, 0.088, 1, max_len, out, num_kv_splits=splits,
                        seq_order=seq_order, heads_inner=inner)
                    run()
                    assert (out.float() - ref.float()).abs().max().item() < 2e-2
                    us = timed(run) * 1e3
                    pair.append(f"{us:6.1f}")
                    best = min(best, (us, f"{splits} {name}"))
                cells.append(f"{splits}: {'/'.join(pair)}")
            print(f"H={heads:<2} KH={kv_heads} bs={batch:<4} [{chosen}] " + " | ".join(cells)
                  + f"  best {best[1]} {best[0]:.1f} us = {kv_bytes / best[0] / 1e3:.0f} GB/s")


def decode_tiles(block_n: int, stages: int, warps: int):
    """A _TileConfig whose decode tiles are these (prefill tiles unchanged)."""
    class Tiles(A._TileConfig):
        def __init__(self, max_query_len, group_p, head_dim):
            super().__init__(max_query_len, group_p, head_dim)
            if max_query_len == 1:
                self.block_n, self.num_stages, self.num_warps = block_n, stages, warps
    return Tiles


def sweep_tiles(args) -> None:
    """us a launch of decode attention (D 128: Llama-3-8B 32 / 8 heads, Qwen3-0.6B 16 / 8) per decode
    tile, longest first."""
    tiles = [tuple(map(int, t.split("x"))) for t in args.tiles.split(",")]
    default = A._TileConfig
    print(f"decode attention, D 128, contexts {args.lo}-{args.hi}: us a launch (median of 3) by decode tile "
          "BLOCK_N x stages x warps, the heuristic's splits, longest first")
    shapes = [(int(h), int(kh), int(b)) for h, kh in (p.split("/") for p in args.heads.split(","))
              for b in args.batches.split(",")]
    for heads, kv_heads, batch in shapes:
        q, k, v, tables, qsl, seq_lens, max_len, kv_bytes = make_inputs(heads, kv_heads, 128, batch, lo=args.lo,
                                                                         hi=args.hi)
        out = torch.empty_like(q)
        order = torch.argsort(seq_lens, descending=True).to(torch.int32)
        ref = A.launch_paged_attention(q, k, v, tables, qsl, seq_lens, 0.088, 1, max_len, num_kv_splits=1)
        cells, best = [], (1e9, "")
        for block_n, stages, warps in tiles:
            A._TileConfig = decode_tiles(block_n, stages, warps)
            A._PLANS.clear()
            run = lambda: A.launch_paged_attention(  # noqa: E731
                q, k, v, tables, qsl, seq_lens, 0.088, 1, max_len, out, seq_order=order)
            try:
                run()
                assert (out.float() - ref.float()).abs().max().item() < 2e-2
                us = timed(run) * 1e3
            except Exception as e:  # a tile that does not fit shared memory, or a wrong result: named in its cell
                cells.append(f"{block_n}x{stages}x{warps}: {type(e).__name__}")
                continue
            finally:
                A._TileConfig = default
                A._PLANS.clear()
            cells.append(f"{block_n}x{stages}x{warps}: {us:6.1f}")
            best = min(best, (us, f"{block_n}x{stages}x{warps}"))
        print(f"H={heads:<2} KH={kv_heads} bs={batch:<4} " + " | ".join(cells)
              + f"  best {best[1]} {best[0]:.1f} us = {kv_bytes / best[0] / 1e3:.0f} GB/s")


if __name__ == "__main__":
    main()
