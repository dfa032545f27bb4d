"""Where a serving engine's mixed steps go, without the server (a diagnostic, issue 19).

A closed loop of C clients on the engine core in this process: each finished request is replaced at
once (random prompts of --input-len, --output-len tokens, ignore_eos), as `bench serve
--max-concurrency C` does against `atomctl serve`. Steps are timed by kind (the step timeline), and
the host's side of each step is split into: time blocked waiting for the device (the executor's
resolve), the launch (schedule + inputs + issuing the forward), and the rest (outputs). A step
whose wait is near zero is host-bound. --cprofile N: the top N functions by own time over the
measured steps. --cuda-trace N: a CUDA-only profiler trace of the first N measured steps, each
opened by a marker kernel, read by cuda_gaps.py (device idle before, inside and after each step).

    python3 tests/gpu/diag_mixed_steps.py --model preset:Llama-3-8B --concurrency 64 -- --mixed-step-tokens-per-seq 8
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import time

import torch

from atom_core import LLMEngine, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="preset:Llama-3-8B")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--requests", type=int, default=320)
    parser.add_argument("--warm-requests", type=int, default=64, help="finished before timing starts")
    parser.add_argument("--cprofile", type=int, default=0)
    parser.add_argument("--cuda-trace", type=int, default=0, help="steps in a CUDA-only trace (cuda_gaps.py)")
    parser.add_argument("--trace-dir", default="/tmp")
    parser.add_argument("--engine", default="{}", help="JSON of extra EngineConfig fields")
    args = parser.parse_args()
    fields = {"load_format": "dummy", "max_model_len": 4096, "num_scheduler_steps": 1,
              "cudagraph_mode": "full_and_piecewise", **json.loads(args.engine)}
    engine = LLMEngine(args.model, **fields)
    core = engine.core
    vocab = core.vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    timers = {"launch": 0.0, "wait": 0.0}
    launch, resolve = core.executor.launch, core.executor.resolve

    def timed(name, fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timers[name] += time.perf_counter() - start
        return wrapper

    core.executor.launch = timed("launch", launch)
    trace = {"profiler": None, "kinds": [], "left": args.cuda_trace}
    traced_launch = core.executor.launch

    def marked_launch(out, previous):
        if trace["profiler"] is not None and trace["left"] > 0:
            torch.cuda._sleep(100)  # the step's marker kernel (cuda_gaps.MARKER)
            trace["left"] -= 1
            n = len(out)
            trace["kinds"].append(f"decode bs{(n + 15) // 16 * 16}" if out.is_decode_only
                                  else f"mixed {(out.total_tokens + 127) // 128 * 128} tok")
        return traced_launch(out, previous)

    core.executor.launch = marked_launch
    core.executor.resolve = timed("wait", resolve)
    sent = finished = 0

    def submit():
        nonlocal sent
        engine.add_request([rng.randrange(100, min(vocab, 30000)) for _ in range(args.input_len)], params)
        sent += 1

    for _ in range(args.concurrency):
        submit()
    profiler = cProfile.Profile() if args.cprofile else None
    start = None
    steps = 0

    def start_timing():
        core.start_step_timeline()
        timers.update(launch=0.0, wait=0.0)
        if profiler:
            profiler.enable()
        if args.cuda_trace:
            from torch.profiler import ProfilerActivity, profile

            trace["profiler"] = profile(activities=[ProfilerActivity.CUDA])
            trace["profiler"].__enter__()
        return time.perf_counter()

    if args.warm_requests == 0:  # the whole run, as bench serve times it
        start = start_timing()
    while engine.core.has_unfinished():
        for st in engine.step():
            if st.finished:
                finished += 1
                if sent < args.requests:
                    submit()
        if start is None and finished >= args.warm_requests:
            start, steps = start_timing(), 0
        steps += 1
        if trace["profiler"] is not None and trace["left"] == 0:
            finish_trace(trace, args.trace_dir)
    if profiler:
        profiler.disable()
    wall = time.perf_counter() - start
    summary = core.stop_step_timeline()
    print(json.dumps({"wall_s": wall, "steps": steps, "output_tok_per_s": summary["total"]["decode_tokens"] / wall,
                      "host_launch_ms_per_step": 1000 * timers["launch"] / steps,
                      "host_wait_ms_per_step": 1000 * timers["wait"] / steps,
                      "with_prompt": summary["with_prompt"], "decode_only": summary["decode_only"]}, indent=1))
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.cprofile)


def finish_trace(trace: dict, trace_dir: str) -> None:
    """Stop the CUDA-only trace (its last marker closes the last step), save it and report its gaps."""
    import os

    from cuda_gaps import report

    torch.cuda._sleep(100)
    torch.cuda.synchronize()
    prof, trace["profiler"], trace["left"] = trace["profiler"], None, -1
    prof.__exit__(None, None, None)
    path = os.path.join(trace_dir, "cuda_gaps_trace.json")
    prof.export_chrome_trace(path)
    report(path, trace["kinds"])


if __name__ == "__main__":
    main()
