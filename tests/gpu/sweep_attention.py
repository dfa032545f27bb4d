"""Decode paged-attention schedule sweep on the GPU: KV splits x sequence order per batch size.

Diagnostic, not a test: `python3 tests/gpu/sweep_attention.py` prints one line per shape with
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
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
