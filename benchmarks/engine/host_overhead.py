"""Host-side cost of one engine step, with the model and sampler stubbed out.

`python -m benchmarks.engine.host_overhead MODEL_DIR [--batch 256] [--steps 200] [--runs 6]`
runs the real scheduler, KV manager, batch builder, async stepping and output processing on the
CPU while the forward and the sampler return instantly, and prints the minimum CPU time per step
over several runs. On a GPU this is the work that async scheduling must hide behind each step.
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from atom_core.engine.llm_engine import LLMEngine
from atom_core.model_ops.sampler import SamplerOutput
from atom_core.sampling_params import SamplingParams


def stub_model(engine: LLMEngine) -> None:
    runner = engine.core.executor.runner
    hidden = runner.model_info.hf_config.hidden_size
    runner.model.forward = lambda ids, pos: torch.zeros(ids.shape[0], hidden)
    runner.model.compute_logits = lambda h: torch.zeros(h.shape[0], 8)
    runner.sampler.forward = lambda logits, sb: SamplerOutput(token_ids=torch.full((logits.shape[0],), 7))


def host_ms_per_step(model: str, batch: int = 256, steps: int = 200, runs: int = 6) -> float:
    torch.set_num_threads(1)
    engine = LLMEngine(model, device="cpu", max_num_seqs=batch, num_kv_blocks=batch * 64)
    stub_model(engine)
    rng = random.Random(0)
    vocab = min(500, engine.core.vocab_size)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(10, 50))] for _ in range(batch)]
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=steps)
    engine.generate(prompts[:4], params)
    best = float("inf")
    for _ in range(runs):
        start = time.process_time()
        engine.generate(prompts, params)
        best = min(best, (time.process_time() - start) / (steps + 1))
    return best * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--runs", type=int, default=6)
    args = parser.parse_args()
    print(f"host-only step at batch {args.batch}: {host_ms_per_step(args.model, args.batch, args.steps, args.runs):.3f} ms CPU")


if __name__ == "__main__":
    main()
