"""EAGLE-3 draft cost on a GPU: a random head for a dummy-weight target, K drafts per step timed
against a plain decode step of the same engine.

Writes a head config (the public layout's config.json; with a dummy-weight target the engine
fills the head with random weights too, so acceptance is ~0 and every step drafts K tokens),
starts one engine with --method eagle3, and measures at batch 1 on a long decode:
  plain_step_ms   a decode step with the proposer off (decode graphs, one host round trip a step)
  spec_step_ms    a step with drafting on (verify of 1 + K tokens, then the head's K drafts)
  verify_step_ms  the same speculative steps with drafts that cost nothing (a proposer handing back K
                  fixed tokens: verified and rejected as the random head's are), so
                  spec_step_ms - verify_step_ms is what the head's drafting adds to a step, host included
  draft_ms        the proposer's own time per step (the fc, catch-up and K - 1 later drafts),
                  synchronized around `Proposer.draft`
and reports draft_ms / plain_step_ms (the issue's target: <= 0.15 for K = 3 on Llama-3-8B) and the
added cost over plain_step_ms beside it.
With --mtp-graphs a step's whole draft loop is one graph replay (spec_decode/mtp_graphs.py).
--profile N profiles N more spec-decode steps (torch.profiler) and reports, per draft, its wall time,
its span on the GPU, the kernel time and the GPU's idle time inside that span, its graph and kernel
launches (one graph launch: the draft replayed its graph), its kernels by total time and the host's
operators inside it by self time (where a draft's time goes).
Without CUDA it runs on the CPU (no graphs: --mtp-graphs is inert there), e.g. on a tiny model
directory to check the command before a GPU run.
Usage:
  python -m benchmarks.engine.eagle3_overhead preset:Llama-3-8B --k 3 [--mtp-graphs] --out eagle3.json
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from atom_core import LLMEngine, SamplingParams
from atom_core.loader import resolve_model_files
from atom_core.spec_decode.proposer import NoProposer, Proposer


def write_head_config(target: str, out: Path, draft_vocab: int) -> Path:
    """An EAGLE-3 head config for `target` (Llama-3-8B's public heads: one Llama layer of the
    target's width, draft vocabulary 32000, default aux layers)."""
    hf = resolve_model_files(target).hf_config
    out.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
              "hidden_size": hf.hidden_size, "intermediate_size": hf.intermediate_size,
              "num_attention_heads": hf.num_attention_heads, "num_key_value_heads": hf.num_key_value_heads,
              "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
              "rms_norm_eps": hf.rms_norm_eps, "max_position_embeddings": hf.max_position_embeddings,
              "rope_parameters": getattr(hf, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 5e5},
              "vocab_size": hf.vocab_size, "draft_vocab_size": min(draft_vocab, hf.vocab_size),
              "tie_word_embeddings": False, "hidden_act": "silu"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_decode(engine, output_len: int) -> float:
    """Seconds per output token of one batch-1 request (after its prefill)."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    prompt = list(range(100, 228))
    engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1))  # the same prefill, to subtract
    sync()
    start = time.perf_counter()
    engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    sync()
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    engine.generate([prompt], params)
    sync()
    return (time.perf_counter() - start - prefill) / (output_len - 1)


DRAFT_RANGE = "eagle3.draft"  # the record_function around each timed draft


class FixedDrafts(Proposer):
    """K drafts of one fixed token for every request, at no cost: the verify steps of speculation
    without the head's work (a random head's drafts are rejected too, so both emit a token a step)."""

    def __init__(self, num_draft_tokens: int, token: int = 0):
        super().__init__(num_draft_tokens)
        self.token = token

    def propose(self, states, target=None) -> list[list[int]]:
        return [[self.token] * self.num_draft_tokens for _ in states]


def _per_draft(times: dict[str, list[float]], n: int, top: int) -> list[dict]:
    ranked = sorted(times.items(), key=lambda kv: -sum(kv[1]))[:top]
    return [{"name": name[:90], "calls_per_draft": round(len(v) / n, 2), "us_per_draft": round(sum(v) / n, 1)}
            for name, v in ranked]


def profile_drafts(engine, steps: int) -> dict:
    """Where a draft's time goes, over `steps` decode steps: its wall time (the DRAFT_RANGE on the host),
    its span on the GPU's timeline (the same range as CUDA records it), the kernel time inside that span,
    so the GPU's idle time inside a draft (span - kernels: host work and launches it waits for), and the
    host's operators inside the range by self time. Kernels are attributed by the GPU span they start in
    (a kernel runs after the host call that launched it); without CUDA there are neither."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        timed_decode(engine, steps + 1)
    events = prof.events()
    cpu = torch.autograd.DeviceType.CPU
    host_ranges = [e.time_range for e in events if e.name == DRAFT_RANGE and e.device_type == cpu]
    gpu_ranges = [e.time_range for e in events if e.name == DRAFT_RANGE and e.device_type != cpu]
    n = max(len(host_ranges), 1)
    kernels: dict[str, list[float]] = {}
    for e in events:
        if e.device_type != cpu and e.name != DRAFT_RANGE and any(
                r.start <= e.time_range.start <= r.end for r in gpu_ranges):
            kernels.setdefault(e.name, []).append(e.time_range.elapsed_us())
    host_ops: dict[str, list[float]] = {}
    for e in events:
        if e.device_type == cpu and e.name != DRAFT_RANGE and any(
                r.start <= e.time_range.start <= r.end for r in host_ranges):
            host_ops.setdefault(e.name, []).append(e.self_cpu_time_total)
    # whether the draft replayed its graph: CUDA runtime calls inside the host ranges (an eager draft
    # launches each kernel; a replay is one cudaGraphLaunch)
    launches = {kind: round(sum(len(v) for name, v in host_ops.items() if kind in name) / n, 2)
                for kind in ("GraphLaunch", "LaunchKernel")}
    kernel_us = sum(map(sum, kernels.values())) / n
    gpu_span_us = sum(r.elapsed_us() for r in gpu_ranges) / n if gpu_ranges else None
    return {"drafts": len(host_ranges), "wall_us_per_draft": round(sum(r.elapsed_us() for r in host_ranges) / n, 1),
            "gpu_span_us_per_draft": None if gpu_span_us is None else round(gpu_span_us, 1),
            "kernel_us_per_draft": round(kernel_us, 1),
            "gpu_idle_us_per_draft": None if gpu_span_us is None else round(gpu_span_us - kernel_us, 1),
            "graph_launches_per_draft": launches["GraphLaunch"], "kernel_launches_per_draft": launches["LaunchKernel"],
            "kernels": _per_draft(kernels, n, 25), "host_ops": _per_draft(host_ops, n, 15)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a target (a preset: dummy weights)")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--mtp-graphs", action="store_true", help="the head's forwards in CUDA graphs")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="profile N spec-decode steps' drafts")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    head = write_head_config(args.model, Path(tempfile.mkdtemp(prefix="eagle3_head_")), args.draft_vocab)
    engine = LLMEngine(args.model, load_format="dummy", max_model_len=args.max_model_len, method="eagle3", draft_model=str(head),
                       num_speculative_tokens=args.k, mtp_graphs=args.mtp_graphs)
    runner = engine.core.executor.runner
    proposer = runner.proposer
    draft_seconds = []

    def timed_draft(result, requests, target):
        sync()
        start = time.perf_counter()
        with torch.profiler.record_function(DRAFT_RANGE):
            drafts = type(proposer).draft(proposer, result, requests, target)
            sync()
        draft_seconds.append(time.perf_counter() - start)
        return drafts

    timed_decode(engine, 32)  # warm-up
    runner.proposer = NoProposer()
    plain = timed_decode(engine, args.output_len)
    runner.proposer = FixedDrafts(args.k)
    verify = timed_decode(engine, args.output_len)
    runner.proposer = proposer
    spec = timed_decode(engine, args.output_len)
    proposer.draft = timed_draft
    timed_decode(engine, args.output_len)
    draft = sorted(draft_seconds)[len(draft_seconds) // 2]
    result = {"model": args.model, "k": args.k, "mtp_graphs": args.mtp_graphs,
              "plain_step_ms": round(plain * 1e3, 3), "spec_step_ms": round(spec * 1e3, 3),
              "verify_step_ms": round(verify * 1e3, 3), "drafting_adds_ms": round((spec - verify) * 1e3, 3),
              "drafting_adds_over_plain_step": round((spec - verify) / plain, 3),
              "draft_ms_median": round(draft * 1e3, 3), "draft_over_plain_step": round(draft / plain, 3),
              "spec_decode": engine.spec_decode_stats()}
    if args.profile:
        result["profile"] = profile_drafts(engine, args.profile)
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
