"""Measure the demo model's MTP layer in the engine: acceptance on the built-in eval prompts and
tokens/s with and without `--method mtp`, greedy (outputs checked identical to plain decoding).

1. Acceptance: the atom_arith held-out questions (atom_core/eval/tasks/atom_arith/heldout.jsonl)
   in the chat format, greedy until <|im_end|> (at most 16 tokens), all submitted at once.
2. Speed at batch 1: longer replies (counting, times tables, stories, lists), one request at a
   time, output tokens / wall seconds of `generate` (prefill included), best of --repeats.

Usage: python recipes/demo-model/measure_mtp.py [--questions 1000] [--k 1 2 3] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from atom_core import LLMEngine, SamplingParams
from atom_core.eval.tasks import TASKS_DIR
from atom_core.loader.model_dir import DEMO_MODEL_DIR

HELDOUT = TASKS_DIR / "atom_arith" / "heldout.jsonl"
LONG_QUESTIONS = ["Count from 1 to 40.", "Tell me a story.", "What is the 7 times table?", "List the months of the year.",
                  "Count from 20 to 60.", "Tell me a story about a fox."]


def chat(question: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def rates(stats: dict) -> dict:
    drafts, tokens, accepted = stats["num_drafts"], stats["num_draft_tokens"], stats["num_accepted_tokens"]
    return {"num_drafts": drafts, "num_draft_tokens": tokens, "num_accepted_tokens": accepted,
            "acceptance_rate": round(accepted / max(tokens, 1), 4),
            "first_position_rate": round(stats["accepted_per_position"][0] / max(drafts, 1), 4),
            "per_position": [round(a / max(drafts, 1), 4) for a in stats["accepted_per_position"]],
            "mean_accepted_length": round(1 + accepted / max(drafts, 1), 3)}


def run(engine: LLMEngine, prompts: list[str], params: SamplingParams) -> tuple[list[list[int]], float]:
    start = time.perf_counter()
    tokens = [o["token_ids"] for o in engine.generate(prompts, params)]
    return tokens, time.perf_counter() - start


def batch1(engine: LLMEngine, prompts: list[str], params: SamplingParams, repeats: int):
    best, tokens = float("inf"), None
    for _ in range(repeats):
        seconds, tokens = 0.0, []
        for p in prompts:
            out, s = run(engine, [p], params)
            tokens += out
            seconds += s
        best = min(best, seconds)
    return tokens, best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=int, default=1000)
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    questions = [json.loads(line)["question"] for line in HELDOUT.read_text().splitlines()[: args.questions]]
    short = SamplingParams(temperature=0, max_tokens=16)
    long = SamplingParams(temperature=0, max_tokens=96)
    long_prompts = [chat(q) for q in LONG_QUESTIONS]
    results = {"questions": len(questions), "long_prompts": LONG_QUESTIONS}

    plain = LLMEngine(str(DEMO_MODEL_DIR))
    eval_ref, eval_s = run(plain, [chat(q) for q in questions], short)
    run(plain, long_prompts[:1], long)  # warm-up
    long_ref, long_s = batch1(plain, long_prompts, long, args.repeats)
    n_long = sum(map(len, long_ref))
    results["plain"] = {"eval_seconds": round(eval_s, 2), "eval_output_tokens": sum(map(len, eval_ref)),
                        "batch1_output_tokens": n_long, "batch1_seconds": round(long_s, 2),
                        "batch1_tokens_per_s": round(n_long / long_s, 1)}
    print("plain", results["plain"], flush=True)
    for k in args.k:
        engine = LLMEngine(str(DEMO_MODEL_DIR), method="mtp", num_speculative_tokens=k)
        tokens, seconds = run(engine, [chat(q) for q in questions], short)
        assert tokens == eval_ref, f"k={k}: greedy output differs from plain decoding on the eval prompts"
        entry = {"eval": {**rates(engine.spec_decode_stats()), "eval_seconds": round(seconds, 2)}}
        run(engine, long_prompts[:1], long)  # warm-up
        warm = engine.spec_decode_stats()
        tokens, seconds = batch1(engine, long_prompts, long, args.repeats)
        assert tokens == long_ref, f"k={k}: greedy output differs from plain decoding on the long prompts"
        after = engine.spec_decode_stats()
        diff = {key: after[key] - warm[key] for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
        diff["accepted_per_position"] = [a - b for a, b in zip(after["accepted_per_position"],
                                                               warm["accepted_per_position"])]
        entry["batch1"] = {**rates(diff), "seconds": round(seconds, 2), "tokens_per_s": round(n_long / seconds, 1),
                           "speedup": round(long_s / seconds, 3)}
        results[f"mtp_k{k}"] = entry
        print(f"mtp k={k}", entry, flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
