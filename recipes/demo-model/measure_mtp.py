"""Measure the demo model's MTP layer in the engine: acceptance on the built-in eval prompts and
tokens/s with and without `--method mtp`, greedy (outputs checked identical to plain decoding).

1. Acceptance: the atom_arith held-out questions (atom_core/eval/tasks/atom_arith/heldout.jsonl)
   in the chat format, greedy until <|im_end|> (at most 16 tokens), all submitted at once.
2. Speed: output tokens per second of `generate` (prefill included), by the wall clock and by
   this process's CPU time, for --timed-questions eval questions (all at once) and at batch 1 for
   longer replies (counting, times tables, stories, lists; one request at a time). Every
   configuration's engine is built first and the timing rounds interleave them, so a noisy
   neighbour on a shared CPU hits all alike. Best and median reported.

Usage: python recipes/demo-model/measure_mtp.py [--questions 1000] [--k 1 2 3] [--rounds 3] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from atom_core import LLMEngine, SamplingParams
from atom_core.eval.tasks import TASKS_DIR
from atom_core.loader.model_dir import DEMO_MODEL_DIR

HELDOUT = TASKS_DIR / "atom_arith" / "heldout.jsonl"
LONG_QUESTIONS = ["Count from 1 to 40.", "Tell me a story.", "What is the 7 times table?",
                  "List the months of the year.",
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


def run(engine: LLMEngine, prompts: list[str], params: SamplingParams):
    """Tokens, and (wall seconds, CPU seconds of this process) of one generate call."""
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = [o["token_ids"] for o in engine.generate(prompts, params)]
    return tokens, (time.perf_counter() - wall, time.process_time() - cpu)


def batch1(engine: LLMEngine, prompts: list[str], params: SamplingParams):
    tokens, wall, cpu = [], 0.0, 0.0
    for p in prompts:
        out, (w, c) = run(engine, [p], params)
        tokens += out
        wall, cpu = wall + w, cpu + c
    return tokens, (wall, cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=int, default=1000)
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--rounds", type=int, default=5, help="timing rounds, configurations interleaved")
    ap.add_argument("--timed-questions", type=int, default=200, help="eval questions in each timing round")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU seconds are not inflated by "
                                                          "threads waiting on each other on a loaded machine)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    questions = [chat(json.loads(line)["question"]) for line in HELDOUT.read_text().splitlines()[: args.questions]]
    short = SamplingParams(temperature=0, max_tokens=16)
    long = SamplingParams(temperature=0, max_tokens=96)
    long_prompts = [chat(q) for q in LONG_QUESTIONS]
    # plain: the LLMEngine default (windows of 8 decode steps, async scheduling); plain-1step:
    # one forward per step, the step structure speculation has (it replaces windows).
    engines = {"plain": LLMEngine(str(DEMO_MODEL_DIR)),
               "plain-1step": LLMEngine(str(DEMO_MODEL_DIR), num_scheduler_steps=1)}
    for k in args.k:
        engines[f"mtp_k{k}"] = LLMEngine(str(DEMO_MODEL_DIR), method="mtp", num_speculative_tokens=k)
    results = {"questions": len(questions), "long_prompts": LONG_QUESTIONS, "rounds": args.rounds}
    reference = {}
    for name, engine in engines.items():  # acceptance (and warm-up): every engine once over both sets
        eval_tokens, _ = run(engine, questions, short)
        before = engine.spec_decode_stats()
        long_tokens, _ = batch1(engine, long_prompts, long)
        after = engine.spec_decode_stats()
        reference.setdefault("eval", eval_tokens)
        reference.setdefault("long", long_tokens)
        assert eval_tokens == reference["eval"] and long_tokens == reference["long"], f"{name}: output differs"
        entry = results[name] = {"eval_output_tokens": sum(map(len, eval_tokens)),
                                 "batch1_output_tokens": sum(map(len, long_tokens))}
        if name.startswith("mtp"):
            diff = {key: after[key] - before[key] for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
            diff["accepted_per_position"] = [a - b for a, b in zip(after["accepted_per_position"],
                                                                   before["accepted_per_position"])]
            entry["eval_acceptance"] = rates(before)
            entry["batch1_acceptance"] = rates(diff)
        print(name, entry, flush=True)
    timed = questions[: args.timed_questions]
    timed_tokens = sum(map(len, reference["eval"][: args.timed_questions]))
    times = {name: {"eval": [], "batch1": []} for name in engines}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            times[name]["eval"].append(run(engine, timed, short)[1])
            times[name]["batch1"].append(batch1(engine, long_prompts, long)[1])
    for name in engines:
        entry = results[name]
        for key, count in (("eval", timed_tokens), ("batch1", entry["batch1_output_tokens"])):
            for clock, j in (("wall", 0), ("cpu", 1)):
                seconds = sorted(t[j] for t in times[name][key])
                entry[f"{key}_{clock}_seconds"] = [round(t[j], 3) for t in times[name][key]]
                entry[f"{key}_{clock}_tokens_per_s_best"] = round(count / seconds[0], 1)
                entry[f"{key}_{clock}_tokens_per_s_median"] = round(count / seconds[len(seconds) // 2], 1)
        print(name, {k: v for k, v in entry.items() if "acceptance" not in k}, flush=True)
    results["timed_questions"] = len(timed)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
