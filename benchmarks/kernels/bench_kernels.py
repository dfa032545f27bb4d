"""Time the Triton kernels against torch on a GPU: `python -m benchmarks.kernels.bench_kernels`.

First checks each kernel against `torch_ref` (max relative L2 error), then prints, per case,
the median time (triton.testing.do_bench) of the Triton kernel, the torch reference and, for
attention, dense torch SDPA on unpaged K/V (a lower bound: no block-table gather). GB/s
counts the bytes a kernel must move: for attention, the KV it reads plus q and out.
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.testing

from atom_core.kernels import torch_ref
from atom_core.kernels import triton as tk
from atom_core.kernels.triton.attention import (
    _TileConfig, choose_num_kv_splits, launch_paged_attention, next_pow2,
)

MODELS = {"llama3-8b": (32, 8, 128), "qwen3-0.6b": (16, 8, 128)}  # (heads, kv heads, head dim)
BLOCK_SIZE = 16
DTYPE = torch.bfloat16


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def bench_ms(fn, graph: bool = True) -> float:
    """Median ms. graph=True replays fn in a CUDA graph: the GPU time the engine's decode graph
    sees, without Python launch overhead. torch_ref syncs (.tolist(), boolean masks): eager."""
    fn()
    torch.cuda.synchronize()
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def make_batch(num_seqs: int, q_len: int, ctx_len: int, heads: int, kv_heads: int, head_dim: int):
    """num_seqs equal sequences of ctx_len cached + q_len new tokens, blocks shuffled."""
    seq_len = ctx_len + q_len
    blocks = triton.cdiv(seq_len, BLOCK_SIZE)
    num_blocks = num_seqs * blocks
    tables = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(num_seqs, blocks)
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, device="cuda", dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    query = torch.randn(num_seqs * q_len, heads, head_dim, device="cuda", dtype=DTYPE)
    qsl = torch.arange(0, num_seqs + 1, device="cuda", dtype=torch.int32) * q_len
    seq_lens = torch.full((num_seqs,), seq_len, device="cuda", dtype=torch.int32)
    return (query, k_cache, v_cache, tables, qsl, seq_lens, head_dim ** -0.5, q_len, seq_len)


def dense_kv(args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unpaged [S, H, q, D] query and [S, KH, L, D] K/V for the SDPA baseline."""
    query, k_cache, v_cache, tables, qsl, seq_lens, _, q_len, seq_len = args
    num_seqs, kv_heads, head_dim = tables.shape[0], k_cache.shape[2], k_cache.shape[3]

    def gather(cache):
        return cache[tables.long()].view(num_seqs, -1, kv_heads, head_dim)[:, :seq_len].transpose(1, 2).contiguous()

    q = query.view(num_seqs, q_len, -1, head_dim).transpose(1, 2)
    return q, gather(k_cache), gather(v_cache)


def attention_row(model: str, num_seqs: int, q_len: int, ctx_len: int) -> str:
    heads, kv_heads, head_dim = MODELS[model]
    args = make_batch(num_seqs, q_len, ctx_len, heads, kv_heads, head_dim)
    q, k, v = dense_kv(args)
    t_triton = bench_ms(lambda: tk.paged_attention(*args))
    t_sdpa = bench_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=q_len > 1, enable_gqa=True))
    t_ref = float("nan")  # torch_ref.paged_attention cannot run on CUDA tensors (CPU causal mask)
    elem = args[0].element_size()
    kv_bytes = 2 * num_seqs * (ctx_len + q_len) * kv_heads * head_dim * elem
    io_bytes = 2 * args[0].numel() * elem
    gbps = (kv_bytes + io_bytes) / t_triton / 1e6
    cfg = _TileConfig(q_len, next_pow2(heads // kv_heads), head_dim)
    programs = num_seqs * triton.cdiv(q_len, cfg.block_q) * kv_heads
    splits = choose_num_kv_splits(programs, ctx_len + q_len, args[0].device,
                                  args[0].shape[0] * heads * (head_dim + 1) * 4, cfg.block_n)
    name = f"attn {model} {'decode' if q_len == 1 else 'prefill'} bs={num_seqs} ctx={ctx_len + q_len}"
    return (f"{name:<44} {t_triton * 1e3:>9.1f} {t_ref * 1e3:>10.1f} {t_sdpa * 1e3:>9.1f} "
            f"{gbps:>8.0f}  splits={splits}")


def elementwise_rows(num_tokens: int) -> list[str]:
    hidden, inter = 4096, 14336
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=DTYPE)
    res = torch.randn_like(x)
    w = torch.randn(hidden, device="cuda", dtype=DTYPE)
    gate_up = torch.randn(num_tokens, 2 * inter, device="cuda", dtype=DTYPE)
    q = torch.randn(num_tokens, 32, 128, device="cuda", dtype=DTYPE)
    k = torch.randn(num_tokens, 8, 128, device="cuda", dtype=DTYPE)
    pos = torch.randint(0, 4096, (num_tokens,), device="cuda")
    cache = torch.randn(4096, 128, device="cuda")
    k_cache = torch.empty(triton.cdiv(num_tokens, BLOCK_SIZE) + 1, BLOCK_SIZE, 8, 128, device="cuda", dtype=DTYPE)
    v_cache = torch.empty_like(k_cache)
    slots = torch.randperm(k_cache.shape[0] * BLOCK_SIZE, device="cuda")[:num_tokens].to(torch.int32)
    e = x.element_size()
    cases = {  # name: (triton fn, torch fn, bytes moved)
        "rms_norm": (lambda: tk.rms_norm(x, w, 1e-6), lambda: torch_ref.rms_norm(x, w, 1e-6), 2 * x.numel() * e),
        "fused_add_rms_norm": (lambda: tk.fused_add_rms_norm(x, res, w, 1e-6),
                               lambda: torch_ref.fused_add_rms_norm(x, res, w, 1e-6), 4 * x.numel() * e),
        "silu_and_mul": (lambda: tk.silu_and_mul(gate_up), lambda: torch_ref.silu_and_mul(gate_up),
                         1.5 * gate_up.numel() * e),
        "rotary_embedding": (lambda: tk.rotary_embedding(pos, q, k, cache),
                             lambda: torch_ref.rotary_embedding(pos, q, k, cache), 2 * (q.numel() + k.numel()) * e),
        "store_kv_cache": (lambda: tk.store_kv_cache(k, k, k_cache, v_cache, slots),
                           lambda: torch_ref.store_kv_cache(k, k, k_cache, v_cache, slots), 4 * k.numel() * e),
    }
    rows = []
    for name, (fn, ref_fn, nbytes) in cases.items():
        t, t_ref = bench_ms(fn), bench_ms(ref_fn, graph=False)
        rows.append(f"{name + f' T={num_tokens}':<44} {t * 1e3:>9.1f} {t_ref * 1e3:>10.1f} {'':>9} "
                    f"{nbytes / t / 1e6:>8.0f}")
    return rows


def check_correctness() -> None:
    print("correctness vs torch_ref (relative L2 error, bf16):")
    for model, (heads, kv_heads, head_dim) in MODELS.items():
        for num_seqs, q_len, ctx in ((8, 1, 3000), (2, 200, 700), (64, 1, 1000)):
            args = make_batch(num_seqs, q_len, ctx, heads, kv_heads, head_dim)
            # on CPU copies: torch_ref builds its causal mask on the CPU
            cpu_args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
            ref = torch_ref.paged_attention(*cpu_args).cuda()
            for splits in (1, 4):
                out = launch_paged_attention(*args, num_kv_splits=splits)
                print(f"  paged_attention {model} S={num_seqs} q={q_len} ctx={ctx} splits={splits}: "
                      f"{rel_err(out, ref):.2e}")
    x = torch.randn(64, 4096, device="cuda", dtype=DTYPE)
    w = torch.randn(4096, device="cuda", dtype=DTYPE)
    print(f"  rms_norm: {rel_err(tk.rms_norm(x, w, 1e-6), torch_ref.rms_norm(x, w, 1e-6)):.2e}")
    r = torch.randn_like(x)
    ref_out, ref_res = torch_ref.fused_add_rms_norm(x, r, w, 1e-6)
    out, res = tk.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-6)
    print(f"  fused_add_rms_norm: {rel_err(out, ref_out):.2e} / residual {rel_err(res, ref_res):.2e}")
    g = torch.randn(64, 2 * 14336, device="cuda", dtype=DTYPE)
    print(f"  silu_and_mul: {rel_err(tk.silu_and_mul(g), torch_ref.silu_and_mul(g)):.2e}")
    q, k = torch.randn(64, 32, 128, device="cuda", dtype=DTYPE), torch.randn(64, 8, 128, device="cuda", dtype=DTYPE)
    pos, cache = torch.randint(0, 4096, (64,), device="cuda"), torch.randn(4096, 128, device="cuda")
    ref_q, ref_k = torch_ref.rotary_embedding(pos, q, k, cache)
    out_q, out_k = tk.rotary_embedding(pos, q.clone(), k.clone(), cache)
    print(f"  rotary_embedding: q {rel_err(out_q, ref_q):.2e} k {rel_err(out_k, ref_k):.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-check", action="store_true", help="skip the correctness checks")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels needs a CUDA GPU")
    torch.manual_seed(0)
    if not opts.skip_check:
        check_correctness()
    print(f"\n{torch.cuda.get_device_name()}, bf16, KV block size {BLOCK_SIZE}; median us; triton and sdpa "
          "timed as CUDA-graph replays, torch_ref eager (attention torch_ref is CPU-only: nan); "
          "sdpa = dense unpaged K/V; prefill GB/s is not the limit (FLOP-bound)")
    print(f"{'case':<44} {'triton':>9} {'torch_ref':>10} {'sdpa':>9} {'GB/s':>8}")
    for model in MODELS:
        for num_seqs in (1, 32, 256):
            for ctx in (512, 4096):
                print(attention_row(model, num_seqs, 1, ctx - 1), flush=True)
        print(attention_row(model, 1, 2048, 0), flush=True)
    for num_tokens in (256, 2048):
        for row in elementwise_rows(num_tokens):
            print(row, flush=True)


if __name__ == "__main__":
    main()
