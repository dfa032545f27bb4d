"""Prefill attention on the GPU: paged kernel vs contiguous kernel vs torch SDPA (flash) [vs flash-attn].

    python -m benchmarks.kernels.prefill_attention_bench [--shapes llama-3-8b,qwen3-0.6b]
        [--tokens 2048,8192] [--seqs 1] [--sweep] [--output-json FILE]

One layer's causal attention over `tokens` new tokens split into `seqs` equal sequences with no
cached context (a prompt's first chunk), bf16. Times (median of 3 do_bench medians, us) and
TFLOP/s against the H100's ~785 TFLOP/s bf16 peak (docs: DESIGN.md performance model):
  paged       launch_paged_attention over a shuffled block-16 cache holding the same K/V (today's path)
  contiguous  prefill_attention over the contiguous rows (the CUDA backend's path for prompts without cached context)
  +rope_k     the contiguous path's extra launch that writes roped K rows (rope_k_rows)
  sdpa-flash  torch SDPA pinned to its flash backend, K/V heads repeated to the query heads
  flash-attn  flash_attn_varlen_func, only where the flash-attn package imports
--sweep also times every TILE_CANDIDATES entry of the contiguous kernel (a tile that cannot launch,
e.g. too much shared memory, prints its error). Written in a session without a GPU: NOT yet run.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

PEAK_TFLOPS = 785.0  # measured bf16 dense matmul peak of the H100 here (DESIGN.md)
SHAPES = {  # (query heads, kv heads, head dim) of one layer
    "llama-3-8b": (32, 8, 128),
    "qwen3-0.6b": (16, 8, 128),
    "qwen3-8b": (32, 8, 128),
    "gpt-oss-20b": (64, 8, 64),
}


def causal_flops(lens: list[int], num_heads: int, head_dim: int) -> float:
    """QK^T and PV over the visible (causal) pairs only: 4 * H * D FLOPs per (query, key) pair."""
    return 4.0 * num_heads * head_dim * sum(n * (n + 1) / 2 for n in lens)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="llama-3-8b,qwen3-0.6b")
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--seqs", type=int, default=1, help="equal sequences the tokens are split into")
    ap.add_argument("--sweep", action="store_true", help="time every tile candidate of the contiguous kernel")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    args.shapes = args.shapes.split(",")
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        ap.exit(2, f"unknown shape {unknown[0]!r}; expected some of: {', '.join(SHAPES)}\n")
    try:
        args.tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        args.tokens = [0]
    if any(t <= 0 for t in args.tokens) or args.seqs <= 0 or any(t % args.seqs for t in args.tokens):
        ap.exit(2, "--tokens must be positive integers divisible by --seqs (a positive integer)\n")
    return args


def timed_us(fn, repeats: int = 3) -> float:
    import triton.testing

    return sorted(triton.testing.do_bench(fn, warmup=25, rep=100) for _ in range(repeats))[repeats // 2] * 1e3


def _flash_attn():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def bench_case(shape: str, tokens: int, seqs: int, sweep: bool, device: str = "cuda", timer=timed_us) -> dict:
    """One row of the table. device/timer exist for the CPU smoke test (Triton's interpreter)."""
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    from atom_core.kernels.triton import prefill_attention as pa
    from atom_core.kernels.triton.attention import launch_paged_attention

    heads, kv_heads, head_dim = SHAPES[shape]
    lens = [tokens // seqs] * seqs
    gen = torch.Generator(device=device).manual_seed(tokens)
    q, k, v = (torch.randn(tokens, h, head_dim, device=device, generator=gen, dtype=torch.bfloat16)
               for h in (heads, kv_heads, kv_heads))
    cu = torch.arange(0, tokens + 1, tokens // seqs, dtype=torch.int32, device=device)
    ids = torch.arange(seqs, dtype=torch.int32, device=device)
    scale, n = head_dim ** -0.5, lens[0]
    # the paged cache: each sequence's rows in its own shuffled blocks of 16
    blocks_per_seq = triton.cdiv(n, 16)
    perm = torch.randperm(seqs * blocks_per_seq, device=device, generator=gen).to(torch.int32)
    tables = perm.view(seqs, blocks_per_seq).contiguous()
    k_cache = torch.zeros(seqs * blocks_per_seq, 16, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = (tables.long()[:, :, None] * 16 + torch.arange(16, device=device)).flatten(1)[:, :n].flatten()
    k_cache.view(-1, kv_heads, head_dim)[slots] = k
    v_cache.view(-1, kv_heads, head_dim)[slots] = v
    seq_lens = torch.full((seqs,), n, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    flops = causal_flops(lens, heads, head_dim)
    row = {"shape": shape, "tokens": tokens, "seqs": seqs, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
           "gflop": flops / 1e9}

    def record(name, fn):
        us = timer(fn)
        row[name] = {"us": us, "tflops": flops / us / 1e6, "of_peak": flops / us / 1e6 / PEAK_TFLOPS}

    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=device, generator=gen, dtype=torch.bfloat16)
    positions = torch.arange(tokens, device=device) % n
    cos_sin = torch.randn(n, head_dim, device=device, generator=gen)
    ref = launch_paged_attention(q, k_cache, v_cache, tables, cu, seq_lens, scale, n, n)
    got = pa.prefill_attention(q, k, v, cu, ids, scale, n)
    row["contiguous_vs_paged_rel_err"] = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
    record("paged", lambda: launch_paged_attention(q, k_cache, v_cache, tables, cu, seq_lens, scale, n, n, out))
    record("contiguous", lambda: pa.prefill_attention(q, k, v, cu, ids, scale, n, out))
    record("rope_k", lambda: pa.rope_k_rows(qkv, positions, cos_sin, heads, kv_heads))
    group = heads // kv_heads
    q4, k4, v4 = (t.view(seqs, n, -1, head_dim).transpose(1, 2) for t in (q, k.repeat_interleave(group, 1),
                                                                          v.repeat_interleave(group, 1)))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION if device == "cuda" else SDPBackend.MATH):
        record("sdpa_flash", lambda: scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale))
    flash = _flash_attn() if device == "cuda" else None
    if flash is not None:
        record("flash_attn", lambda: flash(q, k, v, cu, cu, n, n, softmax_scale=scale, causal=True))
    if sweep:
        row["sweep"] = {}
        for cfg in pa.TILE_CANDIDATES:
            name = f"m{cfg.block_m}_n{cfg.block_n}_w{cfg.num_warps}_s{cfg.num_stages}"
            try:
                us = timer(lambda: pa.prefill_attention(q, k, v, cu, ids, scale, n, out, config=cfg))
                row["sweep"][name] = {"us": us, "tflops": flops / us / 1e6}
            except Exception as exc:  # a tile the GPU cannot run (shared memory, registers): report, go on
                row["sweep"][name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
    return row


def format_row(row: dict) -> str:
    cells = [f"{name} {row[name]['us']:8.1f} us {row[name]['tflops']:5.0f} TF/s ({row[name]['of_peak']:.0%})"
             for name in ("paged", "contiguous", "sdpa_flash", "flash_attn") if name in row]
    head = f"{row['shape']:<12} T={row['tokens']:<5} S={row['seqs']:<3}"
    tail = f" | +rope_k {row['rope_k']['us']:.1f} us | err {row['contiguous_vs_paged_rel_err']:.1e}"
    return head + " | ".join(cells) + tail


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("prefill_attention_bench needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}: causal prefill attention, one layer, bf16; TF/s vs {PEAK_TFLOPS:.0f} peak")
    rows = []
    for shape in args.shapes:
        for tokens in args.tokens:
            row = bench_case(shape, tokens, args.seqs, args.sweep)
            rows.append(row)
            print(format_row(row), flush=True)
            for name, cell in row.get("sweep", {}).items():
                print(f"    {name:<16} " + (f"{cell['us']:8.1f} us {cell['tflops']:5.0f} TF/s" if "us" in cell
                                             else cell["error"]))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
