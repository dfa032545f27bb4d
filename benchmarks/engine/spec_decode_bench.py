"""Speculative decoding on a GPU in one process (one engine start): bf16 greedy parity of n-gram
speculation (verify CUDA graphs) against plain decoding, batch-1 TPOT on a repetitive workload
with and without drafts, and the verify step's cost at k = 1..4 against a plain decode step.

Plain decoding reuses the same engine with its proposer off (no drafts: decode graphs, one
host round trip per step, no windows). Usage:
  python -m benchmarks.engine.spec_decode_bench preset:Llama-3-8B --k 4 --out specdec.json
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

from atom_core import LLMEngine, SamplingParams
from atom_core.bench.offline import run_latency
from atom_core.sampling_params import SamplingParams as SP
from atom_core.scheduler_output import SchedulerOutput
from atom_core.spec_decode.proposer import NoProposer
from atom_core.worker.cuda_graph import CUDAGraphRunner
from atom_core.worker.input_batch import RequestState
from atom_core.worker.verify_batch import build_padded_verify_batch


def parity(engine, runner, vocab: int) -> dict:
    rng = random.Random(1)
    motif = lambda n: [rng.randint(0, vocab - 1) for _ in range(n)]  # noqa: E731
    prompts = [motif(16) * 16 for _ in range(4)] + [motif(128) for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    before = engine.spec_decode_stats()["num_accepted_tokens"]
    spec = [o["token_ids"] for o in engine.generate(prompts, params)]
    accepted = engine.spec_decode_stats()["num_accepted_tokens"] - before
    proposer, runner.proposer = runner.proposer, NoProposer()
    plain_out = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True, logprobs=5))
    runner.proposer = proposer
    plain = [o["token_ids"] for o in plain_out]
    first_diff = [next((i for i, (a, b) in enumerate(zip(s, p)) if a != b), None) for s, p in zip(spec, plain)]
    # Where a sequence diverges, how far the speculative token was from the plain step's best, in the
    # plain step's own log-probabilities: bf16 rounding of a 1+k-row verify vs a 1-row decode only
    # flips near-ties (gap of a few hundredths); a real bug picks tokens far from the top.
    gaps = []
    for d, s_ids, out in zip(first_diff, spec, plain_out):
        if d is not None:
            chosen, top = out["logprobs"][d]
            gaps.append(round(chosen - top[s_ids[d]], 4) if s_ids[d] in top else None)
    return {"identical": sum(d is None for d in first_diff), "of": len(prompts), "first_divergence": first_diff,
            "logprob_gap_at_divergence": gaps, "accepted_tokens": accepted}


def latency(engine, runner, spec: bool, output_len: int) -> dict:
    proposer = runner.proposer
    if not spec:
        runner.proposer = NoProposer()
    r = run_latency(engine, 1, 512, output_len, num_iters=2, num_warmup=1, prompt_period=16)
    runner.proposer = proposer
    return {"tpot_ms": r.tpot_s * 1e3, "ttft_ms": r.ttft_s["median"] * 1e3, "spec_decode": r.spec_decode}


def verify_cost(runner, max_k: int, context: int = 512, iters: int = 100) -> dict:
    """ms per forward + logits of one request with 1 + k tokens at `context`, in a CUDA graph."""
    out = {}
    for q in range(1, max_k + 2):
        graphs = CUDAGraphRunner(runner.model, (1,), runner.max_model_len, runner.block_size, runner.device,
                                 query_len=q)
        graphs.pool = runner.dispatcher.pool
        graphs.capture_all()
        num_blocks = -(-(context + q) // runner.block_size)
        state = RequestState("bench", [1] * context, [], SP(), block_ids=list(range(num_blocks)),
                             num_computed_tokens=context - 1)
        step = SchedulerOutput(["bench"], [1], [context - 1], [[2] * (q - 1)])
        flat = build_padded_verify_batch(step, [state], q, runner.block_size, runner.device)
        for _ in range(10):
            runner.model.compute_logits(graphs.replay(flat))
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            runner.model.compute_logits(graphs.replay(flat))
        torch.cuda.synchronize()
        out[f"k={q - 1}"] = (time.perf_counter() - start) / iters * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    start = time.perf_counter()
    engine = LLMEngine(args.model, load_format="dummy", max_model_len=4096, method="ngram",
                       num_speculative_tokens=args.k, ngram_min=2, ngram_max=5)
    runner = engine.core.executor.runner
    result = {"model": args.model, "k": args.k, "startup_s": time.perf_counter() - start,
              "device": torch.cuda.get_device_name()}
    result["parity"] = parity(engine, runner, engine.core.vocab_size)
    print("parity", result["parity"], flush=True)
    result["tpot_spec"] = latency(engine, runner, True, args.output_len)
    result["tpot_plain"] = latency(engine, runner, False, args.output_len)
    result["speedup"] = result["tpot_plain"]["tpot_ms"] / result["tpot_spec"]["tpot_ms"]
    print("latency", result["tpot_spec"], result["tpot_plain"], f"speedup {result['speedup']:.2f}x", flush=True)
    result["verify_step_ms"] = verify_cost(runner, 4)  # writes KV into blocks 0..: last
    print("verify step ms (forward + logits, 1 request, context 512):", result["verify_step_ms"], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    s, p, par = result["tpot_spec"], result["tpot_plain"], result["parity"]
    print("\n| | TPOT ms | acceptance | mean accepted length |\n|---|---|---|---|")
    sd = s["spec_decode"]
    acc = sd["num_accepted_tokens"] / max(sd["num_draft_tokens"], 1)
    mal = 1 + sd["num_accepted_tokens"] / max(sd["num_drafts"], 1)
    print(f"| ngram k={args.k} | {s['tpot_ms']:.2f} | {acc:.1%} | {mal:.2f} |\n| plain (same engine) | {p['tpot_ms']:.2f} | | |")
    print(f"parity: {par['identical']}/{par['of']} identical, logprob gaps at divergence "
          f"{par['logprob_gap_at_divergence']}; verify ms: "
          + ", ".join(f"{k} {v:.2f}" for k, v in result["verify_step_ms"].items()))


if __name__ == "__main__":
    main()
