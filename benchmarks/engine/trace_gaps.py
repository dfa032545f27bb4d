"""Per-step GPU busy time against the step's GPU span, from a serving trace (diagnostic).

`parse-trace` sums kernel time by module; this says how much of each step the device spent
idle between its own kernels (launch gaps: host issue slower than the kernels), grouped by the
step's kind and token count. Under the profiler each step is synchronized at its end, so gaps
between steps are not meaningful; gaps inside a step are (a little inflated by the profiler's
own per-launch cost). `python -m benchmarks.engine.trace_gaps TRACE.json.gz [--top-kernels 12]`
"""
from __future__ import annotations

import argparse
from collections import defaultdict

from atom_core.profiling.trace_events import load_trace
from atom_core.profiling.trace_parser import attribute_kernels


def busy_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--top-kernels", type=int, default=12)
    args = ap.parse_args()
    attribution = attribute_kernels(load_trace(args.trace))
    by_step = defaultdict(list)
    for k in attribution.kernels:
        by_step[k.step].append(k)
    groups = defaultdict(list)  # (kind, token bucket) -> [(span, busy, kernels, decodes)]
    names = defaultdict(lambda: defaultdict(float))
    for step in attribution.steps:
        kernels = by_step.get(step.index)
        if not kernels:
            continue
        tokens, seqs = step.fields.get("tokens", 0), step.fields.get("bs", 0)
        kind = "decode" if step.phase == "decode" else "prefill/mixed"
        bucket = (tokens + 127) // 128 * 128 if kind != "decode" else (seqs + 15) // 16 * 16
        span = max(k.ts + k.dur for k in kernels) - min(k.ts for k in kernels)
        groups[(kind, bucket)].append((span, busy_us([(k.ts, k.ts + k.dur) for k in kernels]), len(kernels), seqs))
        for k in kernels:
            names[(kind, bucket)][k.kernel[:60]] += k.dur
    print(f"{'kind':13s} {'size':>6s} {'steps':>5s} {'seqs':>6s} {'span ms':>8s} {'busy ms':>8s} {'idle %':>7s} "
          f"{'kernels':>8s}")
    for key in sorted(groups):
        rows = groups[key]
        n = len(rows)
        span, busy = sum(r[0] for r in rows) / n / 1e3, sum(r[1] for r in rows) / n / 1e3
        print(f"{key[0]:13s} {key[1]:6d} {n:5d} {sum(r[3] for r in rows) / n:6.1f} {span:8.2f} {busy:8.2f} "
              f"{100 * (1 - busy / span):6.1f}% {sum(r[2] for r in rows) / n:8.0f}")
    biggest = sorted(groups, key=lambda key: -len(groups[key]))[:3]
    for key in biggest:
        n = len(groups[key])
        print(f"--- {key[0]} {key[1]}: top kernels, ms a step ({n} steps)")
        for name, dur in sorted(names[key].items(), key=lambda kv: -kv[1])[:args.top_kernels]:
            print(f"  {dur / n / 1e3:7.3f}  {name}")


if __name__ == "__main__":
    main()
