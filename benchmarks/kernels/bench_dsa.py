"""DeepSeek Sparse Attention decode against dense MLA, one layer's attention on one GPU (the
DeepSeek-V3.2 shapes by default: 128 heads, latent 512 + rope 64; indexer 64 heads of 128,
index_topk 2048; bf16 caches), at batch 32 and context 32K.

    python -m benchmarks.kernels.bench_dsa [--bs 32] [--ctx 32768] [--heads 128] [--index-cache-dtype fp8] [--out f.json]

Times (median CUDA-graph replays, benchmarks/kernels/bench_kernels.py): dense MLA decode
(`mla_attention`) and the sparse step's three kernels (indexer scores, top-k, sparse MLA), each
and together. Bytes counted per step (what each kernel must read or write at least):
  dense:   bs x ctx x (C + R) x 2                               latent rows
  scores:  bs x ctx x D x 2 + bs x ctx x 4                      indexer keys in, scores out
           (fp8 keys, --index-cache-dtype fp8: bs x ctx x (D + 4 x D / 128) + bs x ctx x 4, codes and scales)
  top-k:   bs x ctx x 4 x (passes)                              scores re-read per pass (32 + 2)
  sparse:  bs x topk x (C + R) x 2                              the selected latent rows
The top-k's re-reads come from L2 (a 32K-wide row is 128 KB); its HBM floor is one read.
"""
from __future__ import annotations

import argparse
import json

import torch

from atom_core.kernels.torch_ref import quantize_per_token_head
from atom_core.kernels.triton import dsa_index_scores, dsa_topk, mla_attention, mla_sparse_attention
from benchmarks.kernels.bench_mla import HBM_BYTES_PER_S, make_inputs, time_graph

TOPK_PASSES = 34  # 32 binary-search steps, the count above the threshold, the write pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bs", type=int, default=32)
    parser.add_argument("--ctx", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--index-heads", type=int, default=64)
    parser.add_argument("--index-dim", type=int, default=128)
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--index-cache-dtype", choices=["bf16", "fp8"], default="bf16",
                        help="indexer keys as the engine's --index-cache-dtype stores them (fp8: e4m3 + a scale per 128)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    bs, ctx, topk = args.bs, args.ctx, args.topk
    latent, rope = 512, 64
    mla_args, _ = make_inputs(bs, ctx, args.heads, latent, rope)
    q_latent, q_rope, cache, tables, qsl, seq_lens, scale = mla_args[:7]
    gen = torch.Generator(device="cuda").manual_seed(1)
    index_q = torch.randn(bs, args.index_heads, args.index_dim, device="cuda", generator=gen).bfloat16()
    weights = torch.randn(bs, args.index_heads, device="cuda", generator=gen)
    index_cache = torch.randn(cache.shape[0], cache.shape[1], 1, args.index_dim, device="cuda",
                              generator=gen).bfloat16()
    iscale = args.index_dim ** -0.5
    key_scales, key_bytes = None, args.index_dim * 2
    if args.index_cache_dtype == "fp8":
        groups = max(1, args.index_dim // 128)
        nb, blk = index_cache.shape[:2]
        codes, key_scales = quantize_per_token_head(index_cache.reshape(nb * blk, groups, -1), torch.float8_e4m3fn)
        index_cache, key_scales = codes.view(nb, blk, groups, -1), key_scales.view(nb, blk, groups)
        key_bytes = args.index_dim + 4 * groups

    def index_scores():
        return dsa_index_scores(index_q, weights, index_cache, tables, qsl, seq_lens, iscale, ctx, 1,
                                index_scale_cache=key_scales)

    scores = index_scores()
    slots = dsa_topk(scores, topk, tables, qsl, seq_lens, cache.shape[1], 1)

    def sparse_step():
        s = index_scores()
        mla_sparse_attention(q_latent, q_rope, cache, dsa_topk(s, topk, tables, qsl, seq_lens, cache.shape[1], 1),
                             scale)

    row = latent + rope
    parts = {
        "dense_mla": (lambda: mla_attention(*mla_args), bs * ctx * row * 2),
        "index_scores": (index_scores, bs * ctx * (key_bytes + 4)),
        "topk": (lambda: dsa_topk(scores, topk, tables, qsl, seq_lens, cache.shape[1], 1), bs * ctx * 4),
        "sparse_mla": (lambda: mla_sparse_attention(q_latent, q_rope, cache, slots, scale), bs * topk * row * 2),
    }
    results = {}
    for name, (fn, nbytes) in parts.items():
        seconds = time_graph(fn)
        results[name] = {"us": seconds * 1e6, "bytes": nbytes, "floor_us": nbytes / HBM_BYTES_PER_S * 1e6}
    sparse_bytes = sum(results[n]["bytes"] for n in ("index_scores", "topk", "sparse_mla"))
    results["sparse_total"] = {"us": time_graph(sparse_step) * 1e6, "bytes": sparse_bytes,
                               "floor_us": sparse_bytes / HBM_BYTES_PER_S * 1e6}
    results["sparse_over_dense"] = results["sparse_total"]["us"] / results["dense_mla"]["us"]
    for name, r in results.items():
        if isinstance(r, dict):
            print(f"{name:14s} {r['us']:9.1f} us  {r['bytes'] / 1e6:9.1f} MB  floor {r['floor_us']:8.1f} us")
    print(f"sparse / dense: {results['sparse_over_dense']:.3f} (target <= 0.3)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(vars(args) | {"results": results}, f, indent=2)


if __name__ == "__main__":
    main()
