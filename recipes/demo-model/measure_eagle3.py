"""Measure the demo model's EAGLE-3 head in the engine at batch 1: acceptance and tokens/s on the
built-in eval questions and on longer replies, with and without `--method eagle3` (greedy;
outputs checked identical to plain decoding).

Every request runs alone (batch 1). Output tokens per second of `generate` (prefill included), by
the wall clock and this process's CPU time; configurations interleave in each timing round, so a
noisy neighbour on a shared CPU hits all alike; best and median reported. "plain" is the
LLMEngine default (8-step decode windows), "plain-1step" one forward per step. "prefill" is the
eval questions with max_tokens=1: the prefill alone, which no draft can shorten (its share of
plain-1step's eval time bounds the eval speed-up).

Usage: python recipes/demo-model/measure_eagle3.py [--head DIR] [--questions 100] [--k 2 3 4] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from atom_core import LLMEngine, SamplingParams
from atom_core.loader.model_dir import DEMO_MODEL_DIR
from measure_mtp import HELDOUT, LONG_QUESTIONS, batch1, chat, rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", type=Path, default=DEMO_MODEL_DIR / "eagle3")
    ap.add_argument("--questions", type=int, default=100, help="eval questions, one request at a time")
    ap.add_argument("--k", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    questions = [chat(json.loads(line)["question"]) for line in HELDOUT.read_text().splitlines()[: args.questions]]
    sets = {"eval": (questions, SamplingParams(temperature=0, max_tokens=16)),
            "prefill": (questions, SamplingParams(temperature=0, max_tokens=1)),
            "long": ([chat(q) for q in LONG_QUESTIONS], SamplingParams(temperature=0, max_tokens=96))}
    engines = {"plain": LLMEngine(str(DEMO_MODEL_DIR)),
               "plain-1step": LLMEngine(str(DEMO_MODEL_DIR), num_scheduler_steps=1)}
    for k in args.k:
        engines[f"eagle3_k{k}"] = LLMEngine(str(DEMO_MODEL_DIR), method="eagle3", draft_model=str(args.head),
                                            num_speculative_tokens=k)
    results: dict = {"questions": args.questions, "long_prompts": LONG_QUESTIONS, "rounds": args.rounds}
    reference: dict = {}
    for name, engine in engines.items():  # acceptance (and warm-up): every engine once over both sets
        entry = results[name] = {}
        for key, (prompts, params) in sets.items():
            before = engine.spec_decode_stats()
            tokens, _ = batch1(engine, prompts, params)
            after = engine.spec_decode_stats()
            assert tokens == reference.setdefault(key, tokens), f"{name}: {key} output differs from plain decoding"
            entry[f"{key}_output_tokens"] = sum(map(len, tokens))
            if name.startswith("eagle3"):
                diff = {c: after[c] - before[c] for c in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
                diff["accepted_per_position"] = [a - b for a, b in zip(after["accepted_per_position"],
                                                                       before["accepted_per_position"] or [0] * 9)]
                entry[f"{key}_acceptance"] = rates(diff)
        print(name, entry, flush=True)
    times = {name: {key: [] for key in sets} for name in engines}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            for key, (prompts, params) in sets.items():
                times[name][key].append(batch1(engine, prompts, params)[1])
    for name in engines:
        entry = results[name]
        for key in sets:
            for clock, j in (("wall", 0), ("cpu", 1)):
                seconds = sorted(t[j] for t in times[name][key])
                entry[f"{key}_{clock}_seconds"] = [round(t[j], 3) for t in times[name][key]]
                entry[f"{key}_{clock}_tokens_per_s_best"] = round(entry[f"{key}_output_tokens"] / seconds[0], 1)
                entry[f"{key}_{clock}_tokens_per_s_median"] = round(
                    entry[f"{key}_output_tokens"] / seconds[len(seconds) // 2], 1)
        print(name, {k: v for k, v in entry.items() if "acceptance" not in k}, flush=True)
    for name in engines:
        for key in sets:
            for clock in ("wall", "cpu"):
                best = f"{key}_{clock}_tokens_per_s_best"
                results[name][f"{key}_{clock}_speedup_over_plain"] = round(results[name][best] / results["plain"][best], 3)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
