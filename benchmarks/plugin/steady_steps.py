"""vLLM's steps at a steady concurrency, the plugin on or off: where a served step's time goes.

`vllm bench serve` at concurrency C keeps C requests in flight, so most steps decode C-1 rows
beside a new prompt's prefill chunk. This drives vLLM's own LLMEngine the same way, in one
process (VLLM_ENABLE_V1_MULTIPROCESSING=0, so torch's profiler sees the model's kernels): C
requests in flight, a finished one replaced at once by a fresh random prompt (no prefix hits),
the first wave's lengths staggered so that the run starts in steady state. It prints one RESULT
line with the step times (all steps, steps that decode only, steps that also prefill) and the
output rate, then the kernels of a profiled window of steps by device time, and with --host the
host's calls by their own time too (where a step the GPU should fill waits on Python launches).

Usage (the GPU machine, vLLM on PYTHONPATH as gpu_plugin.sh's VP):
  python3 benchmarks/plugin/steady_steps.py MODEL_DIR [--concurrency 64] [--requests 192]
      [--input-len 1024] [--output-len 128] [--max-model-len 4096] [--profile-steps 40] [--top 25] [--host]
with ATOM_DISABLE_VLLM_PLUGIN=1 for vLLM's own classes (then FLASH_ATTN, as the served native row).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=192)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--profile-steps", type=int, default=40)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--host", action="store_true", help="also profile the host: its calls by own time")
    args = parser.parse_args()

    import torch
    from vllm import LLM, SamplingParams

    plugin = os.environ.get("ATOM_DISABLE_VLLM_PLUGIN", "0") != "1"
    backend = {} if plugin else {"attention_backend": "FLASH_ATTN"}
    llm = LLM(model=args.model, load_format="dummy", dtype="bfloat16", max_model_len=args.max_model_len,
              max_num_batched_tokens=8192, gpu_memory_utilization=0.9, **backend)
    engine = llm.llm_engine
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(0)

    def prompt() -> dict:
        return {"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(args.input_len)]}

    llm.generate([prompt() for _ in range(4)], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    issued = 0

    def add(max_tokens: int) -> None:
        nonlocal issued
        engine.add_request(f"r{issued}", prompt(), SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                  temperature=0.0))
        issued += 1

    for i in range(args.concurrency):  # staggered: one of the first wave finishes every other step or so
        add(max(2, (i + 1) * args.output_len // args.concurrency))
    steps, out_tokens, window = [], 0, None
    cuda = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU]
    if args.host and cuda:
        activities.append(torch.profiler.ProfilerActivity.CPU)
    prof = torch.profiler.profile(activities=activities)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        prefilling = _prefilling(engine)
        t0 = time.perf_counter()
        outputs = engine.step()
        steps.append((time.perf_counter() - t0, prefilling))
        for o in outputs:
            if o.finished:
                out_tokens += len(o.outputs[0].token_ids)
                if issued < args.requests:
                    add(args.output_len)
        if window is None and issued >= args.requests // 2:
            window = len(steps)
            prof.start()
        if window is not None and len(steps) == window + args.profile_steps:
            if cuda:
                torch.cuda.synchronize()
            prof.stop()
    wall = time.perf_counter() - start
    ms = [s * 1e3 for s, _ in steps]
    mixed = [s * 1e3 for s, p in steps if p]
    decode = [s * 1e3 for s, p in steps if not p]
    print("RESULT " + json.dumps({
        "plugin": "on" if plugin else "off", "steps": len(ms), "wall_s": round(wall, 2),
        "out_tokens": out_tokens,
        "out_tok_s": round(out_tokens / wall, 1), "step_ms_median": round(statistics.median(ms), 2),
        "step_ms_mean": round(statistics.mean(ms), 2),
        "decode_only_steps": len(decode), "decode_only_ms_median": round(statistics.median(decode), 2) if decode else None,
        "with_prefill_steps": len(mixed), "with_prefill_ms_median": round(statistics.median(mixed), 2) if mixed else None,
        "with_prefill_ms_mean": round(statistics.mean(mixed), 2) if mixed else None}), flush=True)
    own = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    rows = sorted(prof.key_averages(), key=own, reverse=True)
    total = sum(own(e) for e in rows) or 1
    print(f"kernels of {args.profile_steps} steps: {total / 1e3:.1f} ms of {'device' if cuda else 'CPU'} time")
    for e in rows[:args.top]:
        print(f"{own(e) / 1e3:9.2f} ms {100 * own(e) / total:5.1f}% "
              f"{e.count:6d}x  {e.key[:110]}")
    if args.host and cuda:
        rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        print(f"host calls of {args.profile_steps} steps by own time (wall {args.profile_steps} steps: "
              f"{sum(s for s, _ in steps[window:window + args.profile_steps]) * 1e3:.1f} ms)")
        for e in rows[:args.top]:
            print(f"{e.self_cpu_time_total / 1e3:9.2f} ms {e.count:7d}x  {e.key[:110]}")


def _prefilling(engine) -> bool:
    """Whether the next step holds prompt tokens: a request waits, or a running one has prompt
    tokens left (vLLM's in-process engine core and its scheduler)."""
    scheduler = engine.engine_core.engine_core.scheduler
    return bool(scheduler.waiting) or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running)


if __name__ == "__main__":
    main()
