"""A discrete-event model of `atomctl serve` under `bench serve --max-concurrency C`, on the CPU.

C closed-loop clients each send their next request as soon as the previous one finished. The REAL
scheduler (Scheduler, KVCacheManager, Sequence) decides every step, driven in EngineCore.step's async
order: step k is scheduled while step k-1 runs on the device, then k-1 is resolved. The device and the
host's time to build a step are a cost model (benchmarks/engine/step_cost.py), not a GPU: it is a MODEL,
good for comparing scheduling policies (the prefill hold, the mixed-step cap, the budget, windows) in
seconds, not for absolute numbers. `--cost h200` (default) is calibrated on one H200's served runs, `h100`
on the H100 profiles of docs/PERFORMANCE.md's history; docs/SERVING.md has the policies' table.
Reported as bench serve does: output tok/s, TTFT p50/p99, TPOT p50 (per request), ITL p50 (every gap
between two token chunks of a request).

    python -m benchmarks.engine.serve_sim --concurrency 64 [--seed 0] \
        [--policy 'cap={"mixed_step_tokens_per_seq": 8}' --policy 'at once={"prefill_hold_fraction": 0}'] \
        [--sweep 0,8] [--cost h200] [--cost-json '{"host_mixed_ms": 0}'] [--stop-at-eos] [--json]
"""
from __future__ import annotations

import argparse
import json
import time
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from atom_core.config import SchedulerConfig, serve_prompt_policy
from atom_core.engine.kv_cache import KVCacheManager
from atom_core.engine.scheduler import Scheduler
from atom_core.engine.sequence import Sequence
from atom_core.sampling_params import SamplingParams
from atom_core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from benchmarks.engine.step_cost import COST_PRESETS, StepCost, host_build_ms, step_cost

__all__ = ["COST_PRESETS", "SimResult", "StepCost", "main", "simulate", "step_cost"]

BLOCK_SIZE = 16
DEFAULT_NUM_KV_BLOCKS = 450_000 // BLOCK_SIZE  # ~ an H100's KV cache for Llama-3-8B (bf16)
VOCAB_SIZE = 128_256  # Llama-3's: random prompts of this vocabulary never share a block (no prefix hits)
SAMPLED_TOKEN = 1  # every sampled token but a stopping request's last
EOS_TOKEN = 2


class StepRecord(NamedTuple):
    kind: str  # "prefill" (prompt chunks only), "mixed" (chunks + decodes), "decode" (decode-only)
    ms: float
    tokens: int
    decodes: int
    forwards: int  # > 1: a multi-step decode window


@dataclass
class SimResult:
    concurrency: int
    num_requests: int
    output_len: int
    duration_ms: float  # last finish; clients start at 0 (bench serve's duration)
    output_tokens: int  # as the finished sequences hold them
    ttft_ms: list[float]
    tpot_ms: list[float]
    itl_ms: list[float]  # bench serve's ITL: all requests' gaps between consecutive token arrivals
    steps: list[StepRecord]
    num_preemptions: int
    sim_seconds: float  # CPU wall time of the simulation itself

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.duration_ms * 1e3

    def _steps(self, kind: str) -> list[StepRecord]:
        return [s for s in self.steps if s.kind == kind]

    def summary(self) -> dict:
        mixed, decode, prefill = self._steps("mixed"), self._steps("decode"), self._steps("prefill")
        return {
            "concurrency": self.concurrency,
            "requests": self.num_requests,
            "output_tok_s": round(self.output_tok_s, 1),
            "ttft_p50_ms": round(float(np.percentile(self.ttft_ms, 50)), 1),
            "ttft_p99_ms": round(float(np.percentile(self.ttft_ms, 99)), 1),
            "tpot_p50_ms": round(float(np.percentile(self.tpot_ms, 50)), 2) if self.tpot_ms else None,
            "itl_p50_ms": round(float(np.percentile(self.itl_ms, 50)), 2) if self.itl_ms else None,
            "itl_p99_ms": round(float(np.percentile(self.itl_ms, 99)), 2) if self.itl_ms else None,
            "duration_s": round(self.duration_ms / 1e3, 2),
            "steps": len(self.steps),
            "prefill_steps": len(prefill),
            "mixed_steps": len(mixed),
            "decode_steps": len(decode),
            "decode_forwards": sum(s.forwards for s in decode),
            "prefill_step_ms": _mean([s.ms for s in prefill]),
            "mixed_step_ms": _mean([s.ms for s in mixed]),
            "decode_forward_ms": _mean([s.ms / s.forwards for s in decode]),  # a window's forwards one by one
            "mixed_tokens": _mean([s.tokens for s in mixed]),
            "mixed_decodes": _mean([s.decodes for s in mixed]),
            "mixed_max_tokens": max((s.tokens for s in mixed), default=None),
            "preemptions": self.num_preemptions,
            "sim_s": round(self.sim_seconds, 2),
        }


def _mean(values: list[float]) -> float | None:
    return round(float(np.mean(values)), 2) if values else None


class _Pending(NamedTuple):
    out: SchedulerOutput
    num_sampled: list[int]
    end_ms: float


@dataclass
class _ServeSim:
    scheduler: Scheduler
    cost: StepCost
    num_requests: int
    input_len: int
    output_len: int
    client_latency_ms: float
    host_overhead_ms: float
    rng: np.random.Generator
    stop_at_eos: bool = False  # answers end at EOS after output_len tokens, max_tokens unset (else ignore EOS)
    request_rate: float | None = None  # requests a second, Poisson, sent whatever finishes (else the closed loop)
    arrivals: deque = field(default_factory=deque)  # (time ms, request index), in time order
    arrival_ms: dict = field(default_factory=dict)
    first_ms: dict = field(default_factory=dict)
    last_token_ms: dict = field(default_factory=dict)  # request id -> when its latest tokens arrived
    itl_ms: list = field(default_factory=list)  # every gap between two arrivals of one request's tokens
    finish_ms: dict = field(default_factory=dict)
    steps: list = field(default_factory=list)
    num_submitted: int = 0
    output_tokens: int = 0  # counted from the finished sequences themselves

    def submit(self, t: float) -> None:
        """A client sends its next request at t, if the run has any left."""
        if self.num_submitted < self.num_requests:
            self.arrivals.append((t, self.num_submitted))
            self.num_submitted += 1

    def admit(self, host_ms: float) -> None:
        """The server has received every request sent by host_ms."""
        params = (SamplingParams(max_tokens=None) if self.stop_at_eos
                  else SamplingParams(max_tokens=self.output_len, ignore_eos=True))
        while self.arrivals and self.arrivals[0][0] <= host_ms:
            t, i = self.arrivals.popleft()
            prompt = self.rng.integers(3, VOCAB_SIZE, size=self.input_len).tolist()
            self.scheduler.add(Sequence(f"req-{i}", prompt, params))
            self.arrival_ms[f"req-{i}"] = t

    def launch(self, out: SchedulerOutput, host_ms: float, device_free_ms: float) -> _Pending:
        """Advance the scheduler past `out` and run it on the device after whatever runs there."""
        requests = self.scheduler.requests
        # what each entry samples, read before advance() appends its placeholders
        num_sampled = [1 + len(extra) if p + n == len(requests[rid].token_ids) else 0
                       for rid, n, p, extra in zip(out.req_ids, out.num_scheduled_tokens, out.num_computed_tokens,
                                                   out.extra_tokens)]
        ms = step_cost(out, num_sampled, self.cost)
        self.scheduler.advance(out)
        self.steps.append(_record(out, ms))
        return _Pending(out, num_sampled, max(device_free_ms, host_ms) + ms)

    def resolve(self, step: _Pending, t: float) -> None:
        """The host reads `step`'s tokens at t (the step's device end, or later when the host was busy):
        first tokens and finished requests are stamped t, and those requests' clients send their next."""
        out = step.out
        for rid, k in zip(out.req_ids, step.num_sampled):
            if k and rid in self.scheduler.requests:  # its tokens arrive as one chunk (bench serve's ITL)
                if rid in self.first_ms:
                    self.itl_ms.append(t - self.last_token_ms[rid])
                else:
                    self.first_ms[rid] = t
                self.last_token_ms[rid] = t
        sampled = [self._tokens(rid, k) for rid, k in zip(out.req_ids, step.num_sampled)]
        for seq in self.scheduler.resolve(out, ModelRunnerOutput(list(out.req_ids), sampled)):
            self.finish_ms[seq.request_id] = t
            self.output_tokens += seq.num_output_tokens
            if self.request_rate is None:
                self.submit(t + self.client_latency_ms)

    def _tokens(self, rid: str, k: int) -> list[int]:
        """The k tokens a step sampled for request rid: EOS as its output_len-th output when answers stop at EOS."""
        seq = self.scheduler.requests.get(rid)
        if not self.stop_at_eos or seq is None:
            return [SAMPLED_TOKEN] * k
        first = seq.num_known_output_tokens + 1  # the output number of the chunk's first token
        return [EOS_TOKEN if first + j == self.output_len else SAMPLED_TOKEN for j in range(k)]

    def run(self, concurrency: int) -> None:
        if self.request_rate is None:
            for _ in range(concurrency):
                self.submit(0.0)
        else:  # bench serve --request-rate R: exponential gaps, the first request at 0
            gaps = self.rng.exponential(1e3 / self.request_rate, size=self.num_requests - 1)
            for t in np.concatenate([[0.0], np.cumsum(gaps)]):
                self.submit(float(t))
        host_ms, device_free_ms = 0.0, 0.0
        pending: _Pending | None = None
        while len(self.finish_ms) < self.num_requests:
            self.admit(host_ms)
            out = self.scheduler.schedule()
            if not out.req_ids:  # nothing to run: wait for the step in flight, else the next request
                if pending is not None:
                    host_ms = max(host_ms, pending.end_ms)
                    self.resolve(pending, host_ms)
                    pending = None
                elif self.arrivals:
                    host_ms = max(host_ms, self.arrivals[0][0])
                else:
                    raise RuntimeError("requests wait but none can be scheduled (KV cache too small?)")
                continue
            host_ms += host_build_ms(self.cost, out)
            step = self.launch(out, host_ms, device_free_ms)
            device_free_ms = step.end_ms
            if pending is not None:  # the host waits for step k-1 while step k runs, then resolves it
                host_ms = max(host_ms, pending.end_ms)
                self.resolve(pending, host_ms)
            host_ms += self.host_overhead_ms
            pending = step


def _record(out: SchedulerOutput, ms: float) -> StepRecord:
    decodes = sum(1 for n in out.num_scheduled_tokens if n == 1)
    if out.is_decode_only:
        kind = "decode"
    else:
        kind = "mixed" if decodes else "prefill"
    return StepRecord(kind, ms, out.total_tokens, decodes, out.num_steps)


def simulate(sched_config: SchedulerConfig, cost: StepCost, concurrency: int, num_requests: int, input_len: int,
             output_len: int, num_kv_blocks: int = DEFAULT_NUM_KV_BLOCKS, client_latency_ms: float = 1.0,
             host_overhead_ms: float = 0.0, seed: int = 0, max_model_len: int | None = None,
             stop_at_eos: bool = False, request_rate: float | None = None) -> SimResult:
    """Run num_requests requests of input_len random prompt tokens and output_len output tokens
    through C closed-loop clients; times in ms of the model's clock. stop_at_eos: each answer ends with
    EOS as its output_len-th token and sets no max_tokens, so the scheduler cannot see the end coming
    (else it ignores EOS and max_tokens ends it, as bench serve's --ignore-eos runs do). request_rate:
    open loop, requests sent at Poisson times at this rate a second (concurrency is then ignored)."""
    if request_rate is not None and not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 requests a second, got {request_rate}")
    start = time.perf_counter()
    kv = KVCacheManager(num_kv_blocks, BLOCK_SIZE, enable_prefix_caching=True)
    max_model_len = max_model_len or max(4096, input_len + output_len)
    scheduler = Scheduler(sched_config, kv, max_model_len, [EOS_TOKEN])
    sim = _ServeSim(scheduler, cost, num_requests, input_len, output_len, client_latency_ms, host_overhead_ms,
                    np.random.default_rng(seed), stop_at_eos, request_rate)
    sim.run(concurrency)
    rids = sorted(sim.finish_ms, key=lambda rid: int(rid.split("-")[1]))
    ttft = [sim.first_ms[rid] - sim.arrival_ms[rid] for rid in rids]
    tpot = [(sim.finish_ms[rid] - sim.first_ms[rid]) / (output_len - 1) for rid in rids] if output_len > 1 else []
    return SimResult(concurrency, len(rids), output_len, max(sim.finish_ms.values()), sim.output_tokens, ttft, tpot,
                     sim.itl_ms, sim.steps, scheduler.num_preemptions, time.perf_counter() - start)


# ---- command line ----------------------------------------------------------------------
_COLUMNS = (("policy", "{}"), ("output_tok_s", "{:.0f}"), ("ttft_p50_ms", "{:.0f}"), ("ttft_p99_ms", "{:.0f}"),
            ("tpot_p50_ms", "{:.2f}"), ("itl_p50_ms", "{:.2f}"), ("steps", "{}"), ("mixed_steps", "{}"),
            ("decode_steps", "{}"), ("mixed_tokens", "{:.0f}"), ("mixed_step_ms", "{:.1f}"),
            ("decode_forward_ms", "{:.1f}"), ("sim_s", "{}"))


def _row(summary: dict) -> str:
    return " | ".join("-" if summary[k] is None else fmt.format(summary[k]) for k, fmt in _COLUMNS)


def _policies(args) -> list[tuple[str, dict]]:
    """(label, SchedulerConfig overrides) per row: each --policy, each swept R, else serve's default."""
    rows = []
    for spec in args.policy or []:
        cut = spec.find("={")  # the label may hold '=' itself ("R=8")
        if cut < 1 or not isinstance(fields := json.loads(spec[cut + 1:]), dict):
            raise ValueError(f"--policy takes LABEL=JSON (an object of SchedulerConfig fields), got {spec!r}")
        rows.append((spec[:cut], fields))
    if args.sweep:
        try:
            rows += [(f"R={r}", {"mixed_step_tokens_per_seq": int(r)}) for r in args.sweep.split(",")]
        except ValueError:
            raise ValueError(f"--sweep takes a comma list of integers R, got {args.sweep!r}") from None
    return rows or [("serve default", {})]


def _config(args, fields: dict) -> SchedulerConfig:
    """The row's scheduler: the flags, then its fields, with serve's prompt policy where it names none."""
    base = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
            "num_scheduler_steps": args.num_scheduler_steps}
    return SchedulerConfig(**serve_prompt_policy({**base, **fields}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=None, help="default: 5 x concurrency")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--request-rate", type=float, default=None,
                        help="open loop: requests a second at Poisson times (--concurrency then only sizes --num-prompts)")
    parser.add_argument("--stop-at-eos", action="store_true",
                        help="answers end at EOS after --output-len tokens, no max_tokens (default: ignore EOS)")
    parser.add_argument("--policy", action="append", metavar="LABEL=JSON",
                        help="a row with these SchedulerConfig fields, e.g. 'cap={\"mixed_step_tokens_per_seq\": 8}' "
                             "(repeatable; serve's prefill hold unless the fields choose a policy)")
    parser.add_argument("--sweep", default=None, help="comma list of mixed-step caps R, a row each")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--num-scheduler-steps", type=int, default=1, help="decode windows (serve's default 1)")
    parser.add_argument("--num-kv-blocks", type=int, default=DEFAULT_NUM_KV_BLOCKS)
    parser.add_argument("--client-latency-ms", type=float, default=20.0,
                        help="a finished request's client to its next request in the scheduler (HTTP, tokenizing)")
    parser.add_argument("--host-overhead-ms", type=float, default=0.0, help="host time after each resolve")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cost", choices=sorted(COST_PRESETS), default="h200", help="the GPU's step-cost calibration")
    parser.add_argument("--cost-json", default=None, help="StepCost field overrides, e.g. '{\"gemm_floor_ms\": 5}'")
    parser.add_argument("--json", action="store_true", help="one JSON line per run instead of a table")
    args = parser.parse_args(argv)
    try:  # bad input is a usage error (exit 2, one line), not a traceback
        cost = StepCost.from_json(args.cost_json, COST_PRESETS[args.cost])
        rows = [(label, _config(args, fields)) for label, fields in _policies(args)]
    except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError; an unknown field a TypeError
        parser.error(str(e))
    if args.request_rate is not None and not args.request_rate > 0:
        parser.error(f"--request-rate must be > 0 requests a second, got {args.request_rate}")
    if not args.json:
        print(" | ".join(k for k, _ in _COLUMNS))
    for label, config in rows:
        result = simulate(config, cost, args.concurrency, args.num_prompts or 5 * args.concurrency, args.input_len,
                          args.output_len, args.num_kv_blocks, args.client_latency_ms, args.host_overhead_ms,
                          args.seed, stop_at_eos=args.stop_at_eos, request_rate=args.request_rate)
        summary = {"policy": label, **result.summary()}
        print(json.dumps(summary) if args.json else _row(summary), flush=True)


if __name__ == "__main__":
    main()
