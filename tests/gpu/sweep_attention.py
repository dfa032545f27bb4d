"""Decode paged-attention tile sweep on the GPU: KV bandwidth per (BLOCK_N, warps, stages).

Diagnostic, not a test: `python3 tests/gpu/sweep_attention.py` prints one table per shape
(GB/s of K+V read, against the ~3.0 TB/s HBM ceiling), the current default marked with *.
"""
from __future__ import annotations

import argparse
import random

import torch
import triton
import triton.testing

from atom_core.kernels.triton import attention as A

SHAPES = {  # name: (q heads, kv heads, head_dim, batch)
    "qwen3-0.6b bs128": (16, 8, 128, 128),
    "qwen3-0.6b bs256": (16, 8, 128, 256),
    "llama-3-8b bs64": (32, 8, 128, 64),
}
# The first sweep (docs/PERFORMANCE.md) left these within 3% of each other; kept to watch drift.
CONFIGS = [(128, 4, 2), (128, 4, 3), (64, 2, 2), (64, 4, 2)]
SPLIT_SHAPES = [(16, 8, 128, b) for b in (32, 64, 128)] + [(32, 8, 128, b) for b in (32, 64)]


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


def launch(q, k, v, tables, qsl, seq_lens, out, block_n, warps, stages):
    heads, head_dim = q.shape[1:]
    group = heads // k.shape[2]
    gp = A.next_pow2(group)
    A._paged_attention_kernel[(q.shape[0], k.shape[2], 1)](
        q, k, v, out, out, out, tables, qsl, seq_lens, 0.088 * A.LOG2E, q.shape[0], 1, 1,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), tables.stride(0),
        NUM_HEADS=heads, GROUP=group, GROUP_P=gp, HEAD_DIM=head_dim, BLOCK_D=head_dim,
        KV_BLOCK_SIZE=k.shape[1], BLOCK_M=max(16, gp), BLOCK_Q=1, BLOCK_N=block_n,
        IS_SPLIT=False, DOT_PRECISION=None, DOT_IN_FP32=False, num_warps=warps, num_stages=stages)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    for name in args.shapes.split(","):
        heads, kv_heads, head_dim, batch = SHAPES[name]
        q, k, v, tables, qsl, seq_lens, max_len, kv_bytes = make_inputs(heads, kv_heads, head_dim, batch)
        ref = A.paged_attention(q, k, v, tables, qsl, seq_lens, 0.088, 1, max_len)
        default = A._TileConfig(1, A.next_pow2(heads // kv_heads), head_dim)
        rows = []
        for block_n, warps, stages in CONFIGS:
            out = torch.empty_like(q)
            try:
                launch(q, k, v, tables, qsl, seq_lens, out, block_n, warps, stages)
                torch.cuda.synchronize()
            except Exception as e:  # out of shared memory and the like
                rows.append((block_n, warps, stages, None, type(e).__name__))
                continue
            err = (out.float() - ref.float()).abs().max().item()
            ms = triton.testing.do_bench(lambda: launch(q, k, v, tables, qsl, seq_lens, out, block_n, warps, stages),
                                         warmup=20, rep=100)
            rows.append((block_n, warps, stages, ms, f"err {err:.1e}"))
        print(f"\n== {name}: {kv_bytes / 1e6:.0f} MB of KV, floor {kv_bytes / 3.0e12 * 1e6:.0f} us at 3.0 TB/s")
        for block_n, warps, stages, ms, note in sorted(rows, key=lambda r: r[3] or 1e9):
            mark = "*" if (block_n, warps, stages) == (default.block_n, default.num_warps, default.num_stages) else " "
            if ms is None:
                print(f"{mark} N={block_n:<4} w={warps} s={stages}  failed ({note})")
            else:
                print(f"{mark} N={block_n:<4} w={warps} s={stages}  {ms * 1e3:7.1f} us  {kv_bytes / ms / 1e6:6.0f} GB/s  {note}")
    print("\n== KV splits (default tile): us, then GB/s; * = the heuristic's choice")
    for heads, kv_heads, head_dim, batch in SPLIT_SHAPES:
        q, k, v, tables, qsl, seq_lens, max_len, kv_bytes = make_inputs(heads, kv_heads, head_dim, batch)
        out = torch.empty_like(q)
        chosen = A.choose_num_kv_splits(batch * kv_heads, max_len, q.device, batch * heads * (head_dim + 1) * 4)
        cells = []
        for splits in (1, 2, 3, 4, 8):
            ms = triton.testing.do_bench(lambda: A.launch_paged_attention(
                q, k, v, tables, qsl, seq_lens, 0.088, 1, max_len, out, num_kv_splits=splits), warmup=20, rep=100)
            cells.append(f"{splits}{'*' if splits == chosen else ' '}: {ms * 1e3:6.1f} us {kv_bytes / ms / 1e6:5.0f}")
        order = torch.argsort(seq_lens, descending=True).to(torch.int32)
        ref = A.launch_paged_attention(q, k, v, tables, qsl, seq_lens, 0.088, 1, max_len, num_kv_splits=1)
        for splits in (1, 2):
            A.launch_paged_attention(q, k, v, tables, qsl, seq_lens, 0.088, 1, max_len, out, num_kv_splits=splits,
                                     seq_order=order)
            assert torch.equal(out, ref) or splits > 1
            ms = triton.testing.do_bench(lambda: A.launch_paged_attention(
                q, k, v, tables, qsl, seq_lens, 0.088, 1, max_len, out, num_kv_splits=splits, seq_order=order),
                warmup=20, rep=100)
            cells.append(f"longest-first {splits}: {ms * 1e3:6.1f} us {kv_bytes / ms / 1e6:5.0f}")
        print(f"H={heads} KH={kv_heads} bs={batch:<4} " + " | ".join(cells))


if __name__ == "__main__":
    main()
