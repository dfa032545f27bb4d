"""Batch-N decode time per output token with LoRA adapters against the base model, offline.

Two engines one after the other in this process, on the same dummy-weight model and prompts:
  base   no --enable-lora, every request on the base weights
  lora   --enable-lora with the adapters of --adapters (make_lora_adapters.py writes them), request i
         on adapter i mod n, so every step mixes all n
TPOT is (time of max_tokens=OUT) - (time of max_tokens=1), over OUT - 1: the decode steps alone,
no prefill mixed in. Usage:

    python -m benchmarks.engine.make_lora_adapters preset:Llama-3-8B /tmp/loras --num 8 --rank 16
    python -m benchmarks.engine.lora_tpot preset:Llama-3-8B /tmp/loras --batch-size 32 --out lora.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from atom_core import LLMEngine, SamplingParams


def timed_batch(engine: LLMEngine, prompts: list[list[int]], loras: list[str | None], max_tokens: int) -> float:
    """Seconds until every prompt has max_tokens outputs, request i with adapter loras[i]."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    for prompt, lora in zip(prompts, loras):
        engine.add_request(prompt, params, lora=lora)
    while not engine.is_finished():
        engine.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def decode_tpot_ms(engine: LLMEngine, prompts: list[list[int]], loras: list[str | None], output_len: int,
                   repeats: int) -> float:
    timed_batch(engine, prompts, loras, output_len)  # warm-up: first-use slot writes, caches
    prefill = min(timed_batch(engine, prompts, loras, 1) for _ in range(repeats))
    full = min(timed_batch(engine, prompts, loras, output_len) for _ in range(repeats))
    return (full - prefill) / (output_len - 1) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a preset:NAME or model directory (dummy weights)")
    ap.add_argument("adapters", type=Path, help="a directory of PEFT adapter directories")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    names = sorted(p.name for p in args.adapters.iterdir() if (p / "adapter_config.json").exists())
    if not names:
        raise SystemExit(f"no PEFT adapter directories under {args.adapters}")
    prompts = [[100 + (i * 7 + j) % 1000 for j in range(args.input_len)] for i in range(args.batch_size)]
    common = dict(load_format="dummy", max_num_seqs=args.batch_size, enable_prefix_caching=False)
    result = {"model": args.model, "batch_size": args.batch_size, "adapters": len(names)}
    with LLMEngine(args.model, **common) as engine:
        result["base_tpot_ms"] = decode_tpot_ms(engine, prompts, [None] * len(prompts), args.output_len, args.repeats)
    modules = [f"{n}={args.adapters / n}" for n in names]
    rank = max(json.loads((args.adapters / n / "adapter_config.json").read_text())["r"] for n in names)
    with LLMEngine(args.model, enable_lora=True, lora_modules=modules, max_loras=len(names), max_lora_rank=rank,
                   **common) as engine:
        loras = [names[i % len(names)] for i in range(len(prompts))]
        result["lora_tpot_ms"] = decode_tpot_ms(engine, prompts, loras, args.output_len, args.repeats)
    result["ratio"] = result["lora_tpot_ms"] / result["base_tpot_ms"]
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
