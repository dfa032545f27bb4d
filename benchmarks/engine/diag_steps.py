"""Where the wall time of an offline run goes, per engine phase (diagnostic, not a test).

`python -m benchmarks.engine.diag_steps MODEL [--level 1] [--num-prompts 256] [engine options as k=v]`
wraps the scheduler, runner and output functions with wall-clock timers, runs the nano-vllm
workload (bench offline's default) and prints seconds and ms per step for each phase. Time in
`event.synchronize` is the host waiting for the GPU: when it is small the run is host-bound.
"""
from __future__ import annotations

import argparse
import collections
import time

import torch

from atom_core.bench.offline import ThroughputWorkload
from atom_core.engine import core, output_processor, scheduler
from atom_core.worker import model_runner
from atom_core.engine.llm_engine import LLMEngine

totals: collections.Counter = collections.Counter()
counts: collections.Counter = collections.Counter()


def timed(owner, name: str, label: str | None = None) -> None:
    fn = getattr(owner, name)
    label = label or f"{getattr(owner, '__name__', owner)}.{name}"

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - start
            counts[label] += 1

    setattr(owner, name, wrapper)


def instrument() -> None:
    timed(core.EngineCore, "step")
    timed(scheduler.Scheduler, "schedule")
    timed(scheduler.Scheduler, "advance")
    timed(scheduler.Scheduler, "resolve")
    timed(model_runner.ModelRunner, "launch")
    timed(model_runner, "build_flat_batch", "  launch: build_flat_batch")
    timed(model_runner, "build_sampling_batch", "  launch: build_sampling_batch")
    timed(model_runner.ModelRunner, "_fill_placeholders", "  launch: fill_placeholders")
    timed(model_runner.ModelRunner, "_forward", "  launch: forward (graph replay or eager)")
    timed(model_runner.ModelRunner, "_launch_window", "  launch: multi-step windows")
    timed(model_runner.Sampler, "__call__", "  launch: sampler")
    timed(model_runner, "_to_host_async", "  launch: D2H copy")
    timed(model_runner.ModelRunner, "resolve")
    timed(torch.cuda.Event, "synchronize", "  resolve: event.synchronize (GPU wait)")
    timed(core.EngineCore, "_output", "core._output (per request)")
    timed(output_processor.OutputProcessor, "process")


events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []


def record_gpu_spans() -> None:
    """CUDA events around every launch: the device time each step spans (its kernels plus any
    bubbles while the host is still launching them) and the idle gaps between steps."""
    launch = model_runner.ModelRunner.launch

    def wrapper(self, batch, *args, **kwargs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            return launch(self, batch, *args, **kwargs)
        finally:
            end.record()
            kind = "window" if batch.is_window else ("decode" if batch.is_decode_only else "prefill/mixed")
            events.append((kind, start, end))

    model_runner.ModelRunner.launch = wrapper


def report_gpu_spans() -> None:
    torch.cuda.synchronize()
    spans = collections.Counter()
    counts_by_kind = collections.Counter()
    gaps = 0.0
    for i, (kind, start, end) in enumerate(events):
        spans[kind] += start.elapsed_time(end) / 1e3
        counts_by_kind[kind] += 1
        if i:
            gaps += max(0.0, events[i - 1][2].elapsed_time(start) / 1e3)
    for kind, total in spans.items():
        print(f"GPU span {kind:14s} {total:7.2f} s over {counts_by_kind[kind]} launches")
    print(f"GPU idle between launches {gaps:7.2f} s")


def watch_compiles() -> None:
    """Print every Triton kernel variant first needed during the run (a JIT compile unless the
    disk cache has it) and every Dynamo recompile: both should be none after startup."""
    try:
        from triton import knobs
    except ImportError:
        return

    def hook(*args, **kwargs):
        print("mid-run Triton variant:", str(kwargs.get("repr", ""))[:300], flush=True)
        return False

    knobs.runtime.jit_cache_hook = hook
    torch._logging.set_logs(recompiles=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--level", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--no-order", action="store_true", help="drop the longest-first attention order (A/B)")
    parser.add_argument("options", nargs="*", help="extra engine options as key=value (ints)")
    args = parser.parse_args()
    options = {"max_model_len": 4096, **{k: int(v) for k, v in (o.split("=") for o in args.options)}}
    engine = LLMEngine(args.model, load_format="dummy", level=args.level, **options)
    vocab = engine.core.vocab_size
    max_len = engine.max_model_len // 2 - 1
    prompts, params = ThroughputWorkload(num_prompts=args.num_prompts, max_token_id=min(10000, vocab - 1),
                                         max_input_len=min(1024, max_len), max_output_len=min(1024, max_len)).build()
    engine.generate([[1, 2, 3]] * 4, params[0])  # warm-up
    if args.no_order:
        build = model_runner.build_flat_batch

        def build_without_order(*a, **k):
            flat = build(*a, **k)
            flat.attn.seq_order = None
            return flat

        model_runner.build_flat_batch = build_without_order
    record_gpu_spans()
    instrument()
    watch_compiles()
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o["token_ids"]) for o in outputs)
    steps = counts["EngineCore.step"]
    print(f"{tokens} output tokens in {elapsed:.2f} s = {tokens / elapsed:,.0f} tok/s; {steps} steps, "
          f"{elapsed / steps * 1e3:.2f} ms per step")
    report_gpu_spans()
    sched = engine.core.scheduler
    print(f"KV blocks {engine.core.executor.num_kv_blocks}, preemptions {sched.num_preemptions}, "
          f"attention order {'off' if args.no_order else 'longest first'}")
    print(f"{'phase':48s} {'total s':>8s} {'ms/step':>8s} {'calls':>7s}")
    for label, total in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"{label:48s} {total:8.2f} {total / steps * 1e3:8.3f} {counts[label]:7d}")


if __name__ == "__main__":
    main()
