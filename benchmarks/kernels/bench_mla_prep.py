"""MLA's ops between the projections and the latent attention, fused against unfused (GPU):
`mla_rope_store` (one launch) vs the sequence it replaced (the latent rms_norm, the two
de-interleave cats, the rotary kernel, the cache-row cat, the store), both timed as CUDA-graph
replays, so the per-launch gaps a decode graph pays are counted and Python's are not.

    python -m benchmarks.kernels.bench_mla_prep [--bs 1 32] [--heads 16 128] [--out f.json]

Widths are DeepSeek-V2-Lite's / V3's (nope 128, latent 512, rope 64, interleaved pairs, bf16);
16 heads is V2-Lite, 128 V3 (per rank: 128 / TP). Also checks the fused result against the
unfused one before timing.
"""
from __future__ import annotations

import argparse
import json

import torch

from atom_core.kernels import triton as tk
from benchmarks.kernels.bench_kernels import bench_ms
from atom_core.kernels.torch_ref import deinterleave
from atom_core.model_ops.rotary import RotaryEmbedding

NOPE, LATENT, ROPE, BLOCK_SIZE, MAX_POSITION = 128, 512, 64, 16, 4096


def make_inputs(bs: int, heads: int):
    gen = torch.Generator(device="cuda").manual_seed(0)
    to = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(bs, heads, NOPE + ROPE, generator=gen, **to)
    kv_a = torch.randn(bs, LATENT + ROPE, generator=gen, **to)
    positions = torch.randint(0, MAX_POSITION, (bs,), device="cuda", generator=gen)
    cos_sin = RotaryEmbedding(ROPE, ROPE, MAX_POSITION, 10000.0).cos_sin_cache.cuda()
    num_blocks = 4 * bs // BLOCK_SIZE + 4
    cache = torch.zeros(num_blocks, BLOCK_SIZE, 1, LATENT + ROPE, **to)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda", generator=gen)[:bs]
    weight = torch.rand(LATENT, generator=gen, **to) + 0.5
    return q, kv_a, positions, cos_sin, cache, slots, weight, 1e-6


def unfused(q, kv_a, positions, cos_sin, cache, slots, weight, eps):
    """The MLA backend's ops before mla_rope_store (and the model's separate kv_a_layernorm)."""
    num_tokens = q.shape[0]
    latent, k_pe = kv_a.split([LATENT, ROPE], dim=-1)
    latent = tk.rms_norm(latent, weight, eps)
    q_pe, k_pe = deinterleave(q[..., NOPE:]), deinterleave(k_pe.view(num_tokens, 1, ROPE))
    q_pe, k_pe = tk.rotary_embedding(positions, q_pe.contiguous(), k_pe.contiguous(), cos_sin)
    row = torch.cat([latent.view(num_tokens, 1, LATENT), k_pe], dim=-1)
    tk.store_kv_cache(row, row, cache, cache, slots)
    return q_pe


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bs", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_mla_prep needs a CUDA GPU")
    rows = []
    for heads in args.heads:
        for bs in args.bs:
            inputs = make_inputs(bs, heads)
            fused_cache, unfused_cache = inputs[4].clone(), inputs[4].clone()
            fused_q = tk.mla_rope_store(*inputs[:4], fused_cache, *inputs[5:], True)
            unfused_q = unfused(*inputs[:4], unfused_cache, *inputs[5:])
            max_diff = max((fused_q.float() - unfused_q.float()).abs().max().item(),
                           (fused_cache.float() - unfused_cache.float()).abs().max().item())
            fused_us = 1e3 * bench_ms(lambda: tk.mla_rope_store(*inputs[:4], fused_cache, *inputs[5:], True))
            unfused_us = 1e3 * bench_ms(lambda: unfused(*inputs[:4], unfused_cache, *inputs[5:]))
            rows.append(dict(heads=heads, bs=bs, fused_us=fused_us, unfused_us=unfused_us, max_abs_diff=max_diff))
    print(f"{'heads':>5s} {'bs':>4s} {'fused us':>9s} {'unfused us':>11s} {'saved us':>9s} {'max |diff|':>10s}")
    for r in rows:
        print(f"{r['heads']:5d} {r['bs']:4d} {r['fused_us']:9.2f} {r['unfused_us']:11.2f} "
              f"{r['unfused_us'] - r['fused_us']:9.2f} {r['max_abs_diff']:10.3g}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
