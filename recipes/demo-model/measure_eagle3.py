"""Measure the demo model's EAGLE-3 head in the engine at batch 1: acceptance and the tokens/s
speed-up over plain decoding on the built-in eval questions and on longer replies (greedy;
outputs checked identical to plain decoding).

Every request runs alone (batch 1), with torch's threads fixed (--threads). The configurations
run one after another on each question (interleaved, their order rotating), so a noisy neighbour
on a shared CPU hits all alike; a round is --questions eval questions plus the longer replies.
Each round takes the next questions of the 1,000 (fresh prompts: no prefix-cache hit beyond what
questions share; --repeat reuses the first ones every round, whose prompts are then cached).
Time is this process's CPU time (and wall time) of `generate`, prefill included. Reported per
configuration: output tokens per CPU second, and the speed-up over each plain configuration per
round: its median, min and max over the rounds. The plain ones: "plain", the LLMEngine default
(8-step decode windows: a window runs all its forwards even when the reply ends after the first,
so short replies pay for 8); "plain-1step", one forward a step (the step structure speculation
has) with async scheduling, the default; "plain-1step-sync", the same without async scheduling. On
the CPU a launch runs its forward before returning, so async scheduling overlaps nothing there and
runs one forward past each reply's end (the step launched before the last one resolved): for
3-token replies that is one forward in four, which "plain-1step-sync" does not pay. Speculative
steps wait for the previous step's tokens anyway (they draft from them). Acceptance counts the
timed rounds, per set.

Usage: python recipes/demo-model/measure_eagle3.py [--head DIR] [--questions 100] [--rounds 5]
           [--k 2 3 4] [--threads 1] [--repeat] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from atom_core import LLMEngine, SamplingParams
from atom_core.loader.model_dir import DEMO_MODEL_DIR
from measure_mtp import HELDOUT, LONG_QUESTIONS, chat, rates

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
PLAIN = ("plain", "plain-1step", "plain-1step-sync")


def timed(engine: LLMEngine, prompt: str, params: SamplingParams) -> tuple[list[int], float, float]:
    """One request alone: its tokens, CPU seconds and wall seconds."""
    cpu, wall = time.process_time(), time.perf_counter()
    tokens = engine.generate([prompt], params)[0]["token_ids"]
    return tokens, time.process_time() - cpu, time.perf_counter() - wall


def add_stats(total: dict | None, before: dict, after: dict) -> dict:
    """total plus the spec-decode counters' change from `before` to `after`."""
    k = len(after["accepted_per_position"])
    total = total or {**{c: 0 for c in COUNTERS}, "accepted_per_position": [0] * k}
    out = {c: total[c] + after[c] - before[c] for c in COUNTERS}
    out["accepted_per_position"] = [t + a - b for t, a, b in zip(total["accepted_per_position"],
                                                                 after["accepted_per_position"],
                                                                 before["accepted_per_position"] or [0] * k)]
    return out


def spread(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", type=Path, default=DEMO_MODEL_DIR / "eagle3")
    ap.add_argument("--questions", type=int, default=100, help="eval questions a round, one request at a time")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--k", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (fixed, so CPU time is comparable)")
    ap.add_argument("--repeat", action="store_true", help="the same questions every round (cached prompts)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lines = HELDOUT.read_text().splitlines()
    need = args.questions * (1 if args.repeat else args.rounds + 1)
    if need > len(lines):
        raise SystemExit(f"{args.rounds + 1} rounds of {args.questions} fresh questions need {need} of the "
                         f"{len(lines)}: fewer rounds or questions, or --repeat")
    questions = [chat(json.loads(line)["question"]) for line in lines[:need]]
    short, long = SamplingParams(temperature=0, max_tokens=16), SamplingParams(temperature=0, max_tokens=96)
    engines = {"plain": LLMEngine(str(DEMO_MODEL_DIR)),
               "plain-1step": LLMEngine(str(DEMO_MODEL_DIR), num_scheduler_steps=1),
               "plain-1step-sync": LLMEngine(str(DEMO_MODEL_DIR), num_scheduler_steps=1, async_scheduling=False)}
    for k in args.k:
        engines[f"eagle3_k{k}"] = LLMEngine(str(DEMO_MODEL_DIR), method="eagle3", draft_model=str(args.head),
                                            num_speculative_tokens=k)
    names = list(engines)
    # A warm-up round first (round 0, not timed); every later round times fresh questions.
    sets = [("eval", questions[: args.questions] if args.repeat else questions[r * args.questions:
                                                                             (r + 1) * args.questions])
            for r in range(args.rounds + 1)]
    cpu = {n: {"eval": [0.0] * (args.rounds + 1), "long": [0.0] * (args.rounds + 1)} for n in names}
    wall = {n: {"eval": [0.0] * (args.rounds + 1), "long": [0.0] * (args.rounds + 1)} for n in names}
    tokens = {"eval": [0] * (args.rounds + 1), "long": [0] * (args.rounds + 1)}
    counted = {n: {key: None for key in ("eval", "long")} for n in names if n.startswith("eagle3")}
    for r, (_, eval_prompts) in enumerate(sets):
        work = [("eval", p, short) for p in eval_prompts] + [("long", chat(q), long) for q in LONG_QUESTIONS]
        for i, (key, prompt, params) in enumerate(work):
            reference = None
            for j in range(len(names)):
                name = names[(i + j) % len(names)]
                before = engines[name].spec_decode_stats()
                out, c, w = timed(engines[name], prompt, params)
                assert reference is None or out == reference, f"{name}: output differs from plain decoding"
                reference = out
                cpu[name][key][r] += c
                wall[name][key][r] += w
                if r and name in counted:  # acceptance of the timed rounds, per set
                    counted[name][key] = add_stats(counted[name][key], before, engines[name].spec_decode_stats())
            tokens[key][r] += len(reference)
    results: dict = {"questions_per_round": args.questions, "rounds": args.rounds, "fresh": not args.repeat,
                     "threads": args.threads, "long_prompts": LONG_QUESTIONS,
                     "output_tokens_per_round": {k: v[1:] for k, v in tokens.items()}}
    for name in names:
        entry = results[name] = {}
        for key in ("eval", "long"):
            rounds = range(1, args.rounds + 1)
            entry[f"{key}_cpu_seconds"] = [round(cpu[name][key][r], 3) for r in rounds]
            entry[f"{key}_cpu_tokens_per_s_median"] = round(statistics.median(
                tokens[key][r] / cpu[name][key][r] for r in rounds), 1)
            entry[f"{key}_wall_tokens_per_s_median"] = round(statistics.median(
                tokens[key][r] / wall[name][key][r] for r in rounds), 1)
            for base in PLAIN:
                entry[f"{key}_cpu_speedup_over_{base}"] = spread(
                    [cpu[base][key][r] / cpu[name][key][r] for r in rounds])
                entry[f"{key}_wall_speedup_over_{base}"] = spread(
                    [wall[base][key][r] / wall[name][key][r] for r in rounds])
        for key in counted.get(name, {}):
            entry[f"{key}_acceptance"] = rates(counted[name][key])
        print(name, json.dumps(entry), flush=True)
    print("\nCPU tokens/s (median of the rounds); speed-up over plain-1step and plain-1step-sync: median (min-max)")
    print("| | eval tok/s | over 1step | over 1step-sync | long tok/s | over 1step | over 1step-sync |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in names:
        e = results[name]
        cells = []
        for key in ("eval", "long"):
            cells.append(str(e[f"{key}_cpu_tokens_per_s_median"]))
            for base in ("plain-1step", "plain-1step-sync"):
                x = e[f"{key}_cpu_speedup_over_{base}"]
                cells.append(f"{x['median']}x ({x['min']}-{x['max']})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
