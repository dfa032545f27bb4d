"""Host time of one paged-attention launch, by launch path (diagnostic, not a test).

A piecewise mixed step launches ~100 Triton kernels eagerly between its graphs; at ~512-token
steps the host issuing them was the bound (docs/PERFORMANCE.md, ninth session). This prints the
host microseconds a call for: our wrapper (`paged_attention`, its launch plan cached), the raw
`kernel[grid](...)` JIT path, the compiled kernel's `[grid](*args)` runner, and its bare `run`
with everything but the arguments precomputed; a torch op as the reference. Tiny inputs, so the
device never becomes the bound: `python -m benchmarks.kernels.bench_launch_overhead`.
"""
from __future__ import annotations

import time

import torch

from atom_core.kernels.triton import attention as A
from atom_core.kernels.triton import qkv_prep


def host_us(fn, calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main():
    dev = torch.device("cuda")
    seqs, heads, kv_heads, dim, bs = 8, 32, 8, 128, 16
    k = torch.randn(64, bs, kv_heads, dim, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(seqs, heads, dim, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    tables = torch.arange(seqs * 2, device=dev, dtype=torch.int32).view(seqs, 2)
    qsl = torch.arange(seqs + 1, device=dev, dtype=torch.int32)
    lens = torch.full((seqs,), 20, device=dev, dtype=torch.int32)
    args = (q, k, v, tables, qsl, lens, 0.088, 1, 20, out)
    wrapper = lambda **kw: A.paged_attention(*args, **kw)  # noqa: E731
    wrapper()
    plan = A._paged_plan(q, k, v, tables, qsl, lens, out, 0.088, 1, 20, None, None, None, None, None, 1.0, 1.0)
    layout, kwargs = plan.launch_args
    kernel_args = (q, k, v, out, out, out, tables, qsl, lens, lens, *layout, out.stride(0), out.stride(1),
                   tables.stride(0))
    kernel_kwargs = dict(kwargs, k_scales_ptr=k, v_scales_ptr=v)
    jit = lambda: A._paged_attention_kernel[plan.grid](*kernel_args, **kernel_kwargs)  # noqa: E731
    compiled = jit()
    binder = A._paged_attention_kernel.device_caches[dev.index or 0][-1]
    bound, _, _ = binder(*kernel_args, **kernel_kwargs)
    values = tuple(bound.values())
    runner = compiled[plan.grid]
    stream = torch.cuda.current_stream().cuda_stream
    g = plan.grid
    bare = lambda: compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata,  # noqa: E731
                                None, None, None, *values)
    ref = out.clone()
    for path in (jit, lambda: runner(*values), bare):
        out.zero_()
        path()
        torch.cuda.synchronize()
        assert torch.equal(out, ref), "a launch path computed something else"
    x = torch.randn(16, device=dev)
    qkv = torch.randn(seqs, (heads + 2 * kv_heads) * dim, device=dev, dtype=torch.bfloat16)
    positions = torch.arange(seqs, device=dev)
    cos_sin = torch.randn(64, dim, device=dev)
    slots = torch.arange(seqs, device=dev)
    store = lambda **kw: qkv_prep.qkv_rope_store(qkv, positions, cos_sin, k, v, slots, heads, **kw)  # noqa: E731

    rows = [("torch.add (reference)", lambda: torch.add(x, x)),
            ("paged_attention wrapper, JIT launch", lambda: wrapper(direct_launch=False)),
            ("paged_attention wrapper (PlannedLaunch)", wrapper),
            ("qkv_rope_store wrapper, JIT launch", lambda: store(direct_launch=False)),
            ("qkv_rope_store wrapper (PlannedLaunch)", store),
            ("kernel[grid](...) JIT path", jit), ("compiled[grid](*args)", lambda: runner(*values)),
            ("compiled.run(...) bare", bare)]
    print(f"{len(values)} kernel arguments; host us a call (median of 5 x 2,000 calls):")
    for name, fn in rows:
        us = sorted(host_us(fn) for _ in range(5))[2]
        print(f"  {name:40s} {us:7.2f}")


if __name__ == "__main__":
    main()
