"""Several offline benchmarks on ONE engine (device time is scarce): latency and nano throughput
for each multi-step setting, plus the startup breakdown. Same workloads as `atomctl bench
offline` / `bench latency` (atom_core.bench.offline); prints a table and writes JSON.

`python -m benchmarks.engine.bench_matrix MODEL --level 3 --steps 1,8 --latency-bs 1,32 --out results.json`
"""
from __future__ import annotations

import argparse
import json
import time

from atom_core import LLMEngine
from atom_core.bench.offline import ThroughputWorkload, as_json, run_latency, run_throughput


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--level", type=int, default=3)
    parser.add_argument("--steps", default="1,8", help="num_scheduler_steps values to run")
    parser.add_argument("--latency-bs", default="1", help="batch sizes for bench latency (empty: none)")
    parser.add_argument("--no-throughput", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--max-model-len", type=int, default=4096)
    args = parser.parse_args()
    start = time.perf_counter()
    engine = LLMEngine(args.model, load_format="dummy", max_model_len=args.max_model_len, level=args.level)
    startup = time.perf_counter() - start
    breakdown = engine.core.executor.startup_breakdown
    print(f"start to ready {startup:.1f} s: " + ", ".join(f"{k} {v:.1f}" for k, v in breakdown.items()), flush=True)
    rows, results = [], {"startup_s": startup, "startup_breakdown_s": breakdown, "runs": []}
    for steps in [int(s) for s in args.steps.split(",")]:
        engine.core.scheduler.num_scheduler_steps = steps
        for bs in [int(b) for b in args.latency_bs.split(",") if b]:
            r = run_latency(engine, bs, 128, 256)
            rows.append((f"latency bs{bs} K{steps}", f"TPOT {r.tpot_s * 1e3:.3f} ms, TTFT {r.ttft_s['median'] * 1e3:.2f} ms"))
            results["runs"].append({"kind": "latency", "steps": steps, **as_json(r)})
            print(rows[-1], flush=True)
        if not args.no_throughput:
            r = run_throughput(engine, ThroughputWorkload())
            rows.append((f"nano offline K{steps}", f"{r.output_throughput:,.0f} output tok/s ({r.elapsed_s:.2f} s)"))
            results["runs"].append({"kind": "throughput", "steps": steps, **as_json(r)})
            print(rows[-1], flush=True)
    print(f"== {args.model} level {args.level}")
    for name, value in rows:
        print(f"{name:24s} {value}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
