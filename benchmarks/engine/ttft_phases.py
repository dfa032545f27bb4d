"""Where a lone prompt's time to first token goes (diagnostic, not a test).

`python -m benchmarks.engine.ttft_phases MODEL [--input-len 128] [--reps 5] [--trace OUT.json.gz]
[engine options as k=v]` warms the engine up, then times `generate(max_tokens=1)` for one prompt
`--reps` times with the phase timers of `diag_steps` (scheduler, batch building, forward,
sampler, copies, GPU waits, output processing) and prints milliseconds per request for each
phase, beside the wall time; then profiles one more request with torch.profiler and prints the
device time per kernel and the host time per op, so a phase that is slow shows which calls make it.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from atom_core.engine.llm_engine import LLMEngine
from atom_core.sampling_params import SamplingParams
from benchmarks.engine import diag_steps


def one_request(engine: LLMEngine, prompt: list[int]) -> float:
    start = time.perf_counter()
    engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    return time.perf_counter() - start


def _value(text: str) -> int | str:
    return int(text) if text.lstrip("-").isdigit() else text


def host_profile(engine: LLMEngine, prompt: list[int], rows: int = 40) -> None:
    """Python-level host time of one request (cProfile), by cumulative time."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(one_request, engine, prompt)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--level", type=int, default=3)
    parser.add_argument("--trace", default=None, help="write the profiled request's chrome trace here")
    parser.add_argument("options", nargs="*", help="extra engine options as key=value (ints where they parse)")
    args = parser.parse_intermixed_args()
    options = {"max_model_len": 4096, **{k: _value(v) for k, v in (o.split("=", 1) for o in args.options)}}
    engine = LLMEngine(args.model, load_format="dummy", level=args.level, **options)
    rng = random.Random(0)
    vocab = engine.core.model.vocab_size

    def prompt() -> list[int]:  # fresh ids each time: no prefix-cache hit
        return [rng.randrange(100, min(vocab, 30000)) for _ in range(args.input_len)]

    for _ in range(3):
        one_request(engine, prompt())
    diag_steps.instrument()
    diag_steps.watch_compiles()
    diag_steps.totals.clear()
    diag_steps.counts.clear()
    walls = [one_request(engine, prompt()) for _ in range(args.reps)]
    print(f"== {args.model}: {args.input_len}-token prompt, max_tokens=1, {args.reps} requests")
    print(f"TTFT wall: median {statistics.median(walls) * 1e3:.2f} ms, min {min(walls) * 1e3:.2f} ms")
    for label, total in sorted(diag_steps.totals.items(), key=lambda kv: -kv[1]):
        calls = diag_steps.counts[label] / args.reps
        print(f"  {label:48s} {total / args.reps * 1e3:8.2f} ms/request ({calls:.1f} calls)")

    host_profile(engine, prompt())
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        one_request(engine, prompt())
    if args.trace:
        prof.export_chrome_trace(args.trace)
    averages = prof.key_averages()
    if torch.cuda.is_available():
        print(averages.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))
    print(averages.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))


if __name__ == "__main__":
    main()
