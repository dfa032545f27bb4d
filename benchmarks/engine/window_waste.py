"""What multi-step decode windows cost answers that end at a stop token (diagnostic, not a test).

`python -m benchmarks.engine.window_waste MODEL [--answers 4,16,128] [--steps 1,8] [--requests 8]
[--input-len 128] [engine options as k=v]` sends --requests prompts one after another (a client that
sends the next when the last one ended: batch 1) whose greedy answers end at a stop token after about N
tokens, for each N and each --num-scheduler-steps value, and prints output tok/s and the median request
time. A stop inside a window leaves the rest of it, and the window launched before the stop was read,
running for nothing; the scheduler grows windows with the answer (1, 2, 4, ...) so a short one pays
little, and this shows what is left. Each prompt's stop token is its own greedy token N - 1 (its first
occurrence ends the answer, so some answers come out shorter), from an ignore-EOS run of the same engine.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from atom_core.engine.llm_engine import LLMEngine
from atom_core.sampling_params import SamplingParams


def _value(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def measure(engine: LLMEngine, prompts: list[list[int]], answer_len: int) -> dict:
    """Batch-1 requests stopping near answer_len tokens: output tok/s, median ms a request, mean tokens."""
    free = SamplingParams(temperature=0.0, max_tokens=answer_len, ignore_eos=True)
    stops = [output["token_ids"][-1] for output in engine.generate(prompts, free)]
    lengths, times = [], []
    start = time.perf_counter()
    for prompt, stop in zip(prompts, stops):
        begin = time.perf_counter()
        params = SamplingParams(temperature=0.0, max_tokens=4 * answer_len + 16, stop_token_ids=[stop])
        (output,) = engine.generate([prompt], params)
        times.append(time.perf_counter() - begin)
        lengths.append(len(output["token_ids"]))
    wall = time.perf_counter() - start
    return {"answer_len": answer_len, "mean_tokens": statistics.mean(lengths), "output_tok_s": sum(lengths) / wall,
            "median_request_ms": statistics.median(times) * 1e3}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--answers", default="4,16,128", help="comma list of answer lengths N")
    parser.add_argument("--steps", default="1,8", help="comma list of --num-scheduler-steps values")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("options", nargs="*", help="extra engine options as key=value")
    args = parser.parse_intermixed_args(argv)
    try:
        answers = [int(n) for n in args.answers.split(",")]
        steps = [int(k) for k in args.steps.split(",")]
    except ValueError:
        parser.error(f"--answers and --steps take comma lists of integers, got {args.answers!r} / {args.steps!r}")
    if min(answers) < 1 or args.requests < 1:
        parser.error("--answers and --requests must be >= 1")
    options = {k: _value(v) for k, v in (o.split("=", 1) for o in args.options)}
    rng = random.Random(0)
    print("num_scheduler_steps | answer_len | mean_tokens | output_tok_s | median_request_ms")
    for k in steps:
        with LLMEngine(args.model, num_scheduler_steps=k, **options) as engine:
            vocab = engine.core.model.vocab_size
            engine.generate([[1, 2, 3]], SamplingParams(max_tokens=8))  # warm-up: compiles, first launches
            for n in answers:
                prompts = [[rng.randrange(100, min(vocab, 30000)) for _ in range(args.input_len)]
                           for _ in range(args.requests)]
                row = measure(engine, prompts, n)
                print(f"{k} | {n} | {row['mean_tokens']:.1f} | {row['output_tok_s']:.1f} | "
                      f"{row['median_request_ms']:.1f}", flush=True)


if __name__ == "__main__":
    main()
