"""nano-vllm's throughput workload with N LoRA adapters round-robin, on our engine or on vLLM.

The same requests on either engine, so one GPU sitting can run both side by side: the workload of
atom_core/bench/offline.py (ThroughputWorkload: random.seed(0), 256 prompts of 100-1024 random ids,
temperature 0.6, ignore_eos, 100-1024 output tokens), request i on adapter i mod N of --adapters
(make_lora_adapters.py writes them), dummy weights. One warm-up request per adapter first, so both
engines have every adapter in a GPU slot before the timed generate. --no-lora runs the base model
with LoRA off, for the adapters' cost as a ratio. Usage (vLLM from its own environment):

    python -m benchmarks.engine.make_lora_adapters preset:Llama-3-8B /tmp/loras --num 8 --rank 16
    python -m benchmarks.engine.lora_nano preset:Llama-3-8B /tmp/loras --engine atom --out atom.json
    python -m benchmarks.engine.lora_nano preset:Llama-3-8B /tmp/loras --engine vllm --out vllm.json

Prints one JSON object: engine, model, adapters, out_tokens, seconds, out_tok_s, startup_s.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Literal, NamedTuple

from atom_core.bench.offline import ThroughputWorkload
from atom_core.loader import resolve_model_files
from benchmarks.engine.model_dir import model_dir

Engine = Literal["atom", "vllm"]


class Adapters(NamedTuple):
    names: list[str]
    paths: list[Path]
    rank: int  # the largest adapter's, what max_lora_rank must hold


class Requests(NamedTuple):
    prompts: list[list[int]]
    max_tokens: list[int]
    temperature: float
    loras: list[int | None]  # index into Adapters.names per request; None: the base model


class Timing(NamedTuple):
    out_tokens: int
    seconds: float
    startup_s: float
    engine: str  # with vLLM's version, so a result says which vLLM it was


def find_adapters(directory: Path) -> Adapters:
    """The PEFT adapter directories under `directory`, by name; SystemExit naming it when there are none."""
    paths = sorted(p for p in directory.iterdir() if (p / "adapter_config.json").exists()) if directory.is_dir() else []
    if not paths:
        raise SystemExit(f"no PEFT adapter directories (with adapter_config.json) under {directory}")
    rank = max(json.loads((p / "adapter_config.json").read_text())["r"] for p in paths)
    return Adapters([p.name for p in paths], paths, rank)


def build_requests(vocab_size: int, num_prompts: int, max_input_len: int, max_output_len: int,
                   num_adapters: int) -> Requests:
    # Token ids stay below the vocab, as run_throughput keeps them (only tiny test models have fewer
    # than 10,001 tokens, so a real model sees nano-vllm's exact prompts).
    workload = ThroughputWorkload(num_prompts, min(100, max_input_len), max_input_len, min(100, max_output_len),
                                  max_output_len, max_token_id=min(10000, vocab_size - 1))
    prompts, params = workload.build()
    loras = [i % num_adapters if num_adapters else None for i in range(num_prompts)]
    return Requests(prompts, [p.max_tokens for p in params], workload.temperature, loras)


def run_atom(model: str, adapters: Adapters | None, requests: Requests, max_model_len: int) -> Timing:
    from atom_core import LLMEngine, SamplingParams

    lora = {} if adapters is None else dict(
        enable_lora=True, lora_modules=[f"{n}={p}" for n, p in zip(adapters.names, adapters.paths)],
        max_loras=len(adapters.names), max_lora_rank=adapters.rank)
    start = time.perf_counter()
    engine = LLMEngine(model, load_format="dummy", max_model_len=max_model_len, **lora)
    startup_s = time.perf_counter() - start
    with engine:
        for name in adapters.names if adapters else [None]:
            engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4), lora=name)
        params = [SamplingParams(temperature=requests.temperature, ignore_eos=True, max_tokens=n,
                                 lora_request=None if i is None else engine.loras.get(adapters.names[i]))
                  for n, i in zip(requests.max_tokens, requests.loras)]
        start = time.perf_counter()
        outputs = engine.generate(requests.prompts, params)
        seconds = time.perf_counter() - start
    return Timing(sum(o["num_tokens_output"] for o in outputs), seconds, startup_s, "atom")


def run_vllm(model: str, adapters: Adapters | None, requests: Requests, max_model_len: int) -> Timing:
    # Where atom_core is installed next to vLLM its plugin would swap our model classes in (which
    # have no vLLM LoRA support), and the baseline would not be vLLM's own.
    os.environ["ATOM_DISABLE_VLLM_PLUGIN"] = "1"
    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest
    except ImportError as e:
        raise SystemExit(f"--engine vllm needs vLLM in this Python environment ({e}); run this script with "
                         f"vLLM's Python, PYTHONPATH at this repository") from None
    with tempfile.TemporaryDirectory(prefix="lora_nano-") as tmp:
        directory = model_dir(model, Path(tmp) / "model")
        lora = {} if adapters is None else dict(
            enable_lora=True, max_loras=len(adapters.names), max_lora_rank=adapters.rank,
            max_cpu_loras=len(adapters.names))
        start = time.perf_counter()
        llm = LLM(model=str(directory), load_format="dummy", dtype="bfloat16", max_model_len=max_model_len,
                  gpu_memory_utilization=0.9, seed=0, **lora)
        startup_s = time.perf_counter() - start
        # vLLM's adapter ids start at 1, as ours do: adapter k is id k + 1 on both engines.
        lora_requests = [] if adapters is None else [
            LoRARequest(n, k + 1, str(p)) for k, (n, p) in enumerate(zip(adapters.names, adapters.paths))]
        for lora_request in lora_requests or [None]:
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False,
                         lora_request=lora_request)
        prompts = [{"prompt_token_ids": p} for p in requests.prompts]
        params = [SamplingParams(temperature=requests.temperature, ignore_eos=True, max_tokens=n)
                  for n in requests.max_tokens]
        per_request = None if adapters is None else [lora_requests[i] for i in requests.loras]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, lora_request=per_request, use_tqdm=False)
        seconds = time.perf_counter() - start
    return Timing(sum(len(o.outputs[0].token_ids) for o in outputs), seconds, startup_s, f"vllm-{vllm.__version__}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a preset:NAME or model directory (dummy weights)")
    ap.add_argument("adapters", type=Path, nargs="?", help="a directory of PEFT adapter directories")
    ap.add_argument("--engine", choices=["atom", "vllm"], default="atom")
    ap.add_argument("--no-lora", action="store_true", help="the base model, LoRA off (adapters not needed)")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--max-output-len", type=int, default=1024)
    ap.add_argument("--max-model-len", type=int,
                    help="default 4096, or the model's max_position_embeddings when that is shorter")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    for flag in ("num_prompts", "max_input_len", "max_output_len", "max_model_len"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be positive")
    if args.adapters is None and not args.no_lora:
        ap.error("an adapters directory is needed unless --no-lora")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    adapters = None if args.no_lora else find_adapters(args.adapters)
    hf_config = resolve_model_files(args.model).hf_config
    max_model_len = args.max_model_len or min(4096, hf_config.max_position_embeddings)
    requests = build_requests(hf_config.vocab_size, args.num_prompts, args.max_input_len, args.max_output_len,
                              len(adapters.names) if adapters else 0)
    run = run_atom if args.engine == "atom" else run_vllm
    timing = run(args.model, adapters, requests, max_model_len)
    result = {"engine": timing.engine, "model": args.model, "adapters": len(adapters.names) if adapters else 0,
              "lora_rank": adapters.rank if adapters else None, "num_prompts": args.num_prompts,
              "out_tokens": timing.out_tokens, "seconds": round(timing.seconds, 3),
              "out_tok_s": round(timing.out_tokens / timing.seconds, 1), "startup_s": round(timing.startup_s, 1)}
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
