"""Micro-benchmark (CUDA): the batched LoRA shrink and expand (kernels/triton/lora.py) at Llama-3-8B's
projections (q/k/v, o, gate/up, down; rank 16, bf16), a decode step of --m tokens spread round-robin
over --adapters slots. CUDA-graph medians in us per launch (shrink, expand, and the pair as a layer
runs it), against the bytes floor at --floor-tbs: the used slots' A and B tables, x, y read and
written, and the float32 partials written and read back.

  python -m benchmarks.kernels.lora_bench [--m 32] [--adapters 8] [--rank 16] [--floor-tbs 3.0] [--sweep]

Each timed call runs over enough table copies (>= 160 MB together, as the 32 layers of a model
are) that they cannot stay in the 50-60 MB L2 between replays; times are per copy. `--sweep` times
shrink split counts and expand N tiles around the default plans instead of the table.
"""
from __future__ import annotations

import argparse

import torch
import triton

from atom_core.kernels import lora_ref
from atom_core.kernels.triton import lora as triton_lora
from atom_core.kernels.triton.common import next_pow2

# projection: (K, output slices) at TP=1
SHAPES = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
          "down": (14336, (4096,))}
COPIES_BYTES = 160 << 20


def _bench_us(fn) -> float:
    from benchmarks.kernels.bench_kernels import bench_ms

    return bench_ms(fn) * 1000


def _setup(name: str, m: int, adapters: int, rank: int):
    k, slices = SHAPES[name]
    n, out = len(slices) * rank, sum(slices)
    table_bytes = adapters * (n * k + out * rank) * 2
    copies = max(1, -(-COPIES_BYTES // table_bytes))
    a = [torch.randn(adapters, n, k, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(copies)]
    b = [torch.randn(adapters, out, rank, device="cuda", dtype=torch.bfloat16) / 4 for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = torch.zeros(m, out, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(m, device="cuda", dtype=torch.int32) % adapters
    meta = lora_ref.lora_layout(slots, adapters)
    offsets = (0, *torch.tensor(slices).cumsum(0).tolist())
    return k, n, out, offsets, a, b, x, y, meta


def floor_us(k: int, n: int, out: int, m: int, used: int, rank: int, split_k: int, tbs: float) -> float:
    tables = used * (n * k + out * rank) * 2
    activations = m * k * 2 + 2 * m * out * 2 + 2 * split_k * m * n * 4
    return (tables + activations) / (tbs * 1e12) * 1e6


def _time(name, m, adapters, rank, shrink_plan=None, expand_plan=None):
    k, n, out, offsets, a, b, x, y, meta = _setup(name, m, adapters, rank)
    shrink_plan = shrink_plan or triton_lora.shrink_plan(m, k, n)
    widths = [hi - lo for lo, hi in zip(offsets[:-1], offsets[1:])]
    expand_plan = expand_plan or triton_lora.expand_plan(m, widths, adapters)
    v = triton_lora.lora_shrink(x, a[0], meta, shrink_plan)

    def shrink():
        for t in a:
            triton_lora.lora_shrink(x, t, meta, shrink_plan)

    def expand():
        for t in b:
            triton_lora.lora_expand(y, v, t, meta, offsets, rank, expand_plan)

    def both():
        for ta, tb in zip(a, b):
            triton_lora.lora_expand(y, triton_lora.lora_shrink(x, ta, meta, shrink_plan), tb, meta, offsets, rank,
                                    expand_plan)

    copies = len(a)
    times = [_bench_us(fn) / copies for fn in (shrink, expand, both)]
    return k, n, out, shrink_plan, expand_plan, times


def _table(m: int, adapters: int, rank: int, tbs: float) -> None:
    used = min(m, adapters)
    print(f"{torch.cuda.get_device_name()}: LoRA rank {rank}, {m} tokens over {adapters} slots; us per launch "
          f"(CUDA graph medians), floor at {tbs} TB/s")
    print(f"{'proj':8} {'shrink':>8} {'expand':>8} {'pair':>8} {'floor':>8} {'x floor':>8}  shrink plan, expand plan")
    total = 0.0
    for name in SHAPES:
        k, n, out, plan, eplan, (t_s, t_e, t_b) = _time(name, m, adapters, rank)
        floor = floor_us(k, n, out, m, used, rank, plan.split_k, tbs)
        total += t_b
        print(f"{name:8} {t_s:8.2f} {t_e:8.2f} {t_b:8.2f} {floor:8.2f} {t_b / floor:8.1f}  {tuple(plan)} "
              f"{tuple(eplan)}")
    print(f"one layer's four pairs: {total:.1f} us; x 32 layers (Llama-3-8B): {total * 32 / 1000:.2f} ms a forward")


def sweep_plans(m: int, k: int, n: int) -> list[tuple[triton_lora.ShrinkPlan, triton_lora.ExpandPlan]]:
    """Shrink K splits (8, 16, 32 slices of a multiple of 64) x expand N blocks (64, 128) x N blocks
    a program (1, 2, 4, 8) around the default plans (the shrink's block_m kept, the expand's 16)."""
    base = triton_lora.shrink_plan(m, k, n)
    plans = []
    for split in (8, 16, 32):
        kps = triton.cdiv(triton.cdiv(k, split), 64) * 64
        block_k = max(16, min(512, next_pow2(kps)))
        shrink = base._replace(split_k=triton.cdiv(k, kps), k_per_split=kps, block_k=block_k,
                               num_stages=1 if block_k >= kps else 3)
        plans += [(shrink, triton_lora.ExpandPlan(16, bn, tiles, 1 if tiles == 1 else 2))
                  for bn in (64, 128) for tiles in (1, 2, 4, 8)]
    return list(dict.fromkeys(plans))  # small K: several split counts round to the same slices


def _sweep(m: int, adapters: int, rank: int) -> None:
    print(f"{'proj':8} {'split':>5} {'bk':>4} {'exp bn':>6} {'tiles':>5} {'shrink':>8} {'expand':>8} {'pair':>8}")
    for name, (k, slices) in SHAPES.items():
        for plan, eplan in sweep_plans(m, k, len(slices) * rank):
            *_, (t_s, t_e, t_b) = _time(name, m, adapters, rank, plan, eplan)
            print(f"{name:8} {plan.split_k:5} {plan.block_k:4} {eplan.block_n:6} {eplan.tiles:5} {t_s:8.2f} {t_e:8.2f} "
                  f"{t_b:8.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, default=32, help="tokens in the step")
    p.add_argument("--adapters", type=int, default=8, help="adapter slots, the tokens round-robin over them")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--floor-tbs", type=float, default=3.0, help="HBM TB/s of the bytes floor")
    p.add_argument("--sweep", action="store_true", help="time split counts and expand N tiles instead")
    args = p.parse_args()
    if args.m < 1 or args.adapters < 1 or args.rank < 1 or args.floor_tbs <= 0:
        p.error("--m, --adapters, --rank and --floor-tbs must be positive")
    if not torch.cuda.is_available():
        raise SystemExit("lora_bench needs a CUDA GPU")
    if args.sweep:
        _sweep(args.m, args.adapters, args.rank)
    else:
        _table(args.m, args.adapters, args.rank, args.floor_tbs)


if __name__ == "__main__":
    main()
