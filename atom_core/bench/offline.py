"""Offline benchmarks on LLMEngine: throughput (nano-vllm's workload) and fixed-batch latency.

Workloads reproduce the reference runs exactly (see ANCHORS in the docs):
- throughput: `random.seed(seed)`; per request, prompt length randint(min_in, max_in) then
  that many ids randint(0, 10000); then per request max_tokens randint(min_out, max_out);
  temperature 0.6, ignore_eos. Defaults give 256 requests and 133,966 output tokens.
  Lengths left at their defaults shrink to fit a model's shorter max_model_len (`fit_workload`).
- latency: batch B of `input_len` random ids, greedy, ignore_eos. TTFT and end-to-end come from
  the same runs: a run's TTFT is when the last of its requests got its first token, its
  end-to-end when the last finished, its TPOT (e2e - TTFT) / (output_len - 1), so no run's TPOT
  is negative. prompt_period P: each prompt repeats a random P-token motif instead (a
  repetitive workload for n-gram drafts).
`on_step` (both) is LLMEngine.generate's: called after every step, for progress bars (`token_counter`).
With speculative decoding, each result carries the timed runs' acceptance counters (`spec_decode`).
With step_timeline, the throughput result carries the timed run's per-step summary
(engine/step_timeline.py): how many steps carried prompt tokens, how many only decoded, and their time.
"""
from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

from atom_core.bench.lengths import Length, fit_lengths
from atom_core.sampling_params import SamplingParams

OnStep = Callable[[list], None]  # LLMEngine.generate's on_step: the RequestStates a step advanced


@dataclass
class ThroughputWorkload:
    num_prompts: int = 256
    min_input_len: int = 100
    max_input_len: int = 1024
    min_output_len: int = 100
    max_output_len: int = 1024
    temperature: float = 0.6
    seed: int = 0
    max_token_id: int = 10000

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"invalid num_prompts={self.num_prompts}: must be >= 1")
        for lo, hi, name in ((self.min_input_len, self.max_input_len, "input"),
                             (self.min_output_len, self.max_output_len, "output")):
            if not 1 <= lo <= hi:
                raise ValueError(f"invalid {name} length range [{lo}, {hi}]: need 1 <= min <= max")

    def build(self) -> tuple[list[list[int]], list[SamplingParams]]:
        rng = random.Random(self.seed)
        prompts = [[rng.randint(0, self.max_token_id) for _ in range(rng.randint(self.min_input_len, self.max_input_len))]
                   for _ in range(self.num_prompts)]
        params = [SamplingParams(temperature=self.temperature, ignore_eos=True,
                                 max_tokens=rng.randint(self.min_output_len, self.max_output_len))
                  for _ in range(self.num_prompts)]
        return prompts, params


def fit_workload(max_model_len: int, num_prompts: int = 256, min_input_len: int | None = None,
                 max_input_len: int | None = None, min_output_len: int | None = None,
                 max_output_len: int | None = None, **rest) -> tuple[ThroughputWorkload, str | None]:
    """The throughput workload for a model of `max_model_len` tokens: None lengths take the
    defaults, the maxima shrunk (in proportion) until the longest prompt plus the longest output
    fits, the minima lowered to the maxima; lengths given are kept (ValueError naming the flags
    when they cannot fit). Returns the workload and the notice of what was shrunk, if anything."""
    base = ThroughputWorkload()
    fitted = fit_lengths([Length("--max-input-len", max_input_len, base.max_input_len),
                          Length("--max-output-len", max_output_len, base.max_output_len)],
                         max_model_len, f"max_model_len {max_model_len}")
    max_in, max_out = fitted.values
    min_in = min_input_len if min_input_len is not None else min(base.min_input_len, max_in)
    min_out = min_output_len if min_output_len is not None else min(base.min_output_len, max_out)
    return ThroughputWorkload(num_prompts, min_in, max_in, min_out, max_out, **rest), fitted.notice


def fit_latency_lengths(max_model_len: int, input_len: int | None, output_len: int | None,
                        defaults: tuple[int, int] = (128, 256)) -> tuple[int, int, str | None]:
    """(input_len, output_len, notice) for `bench latency`, as fit_workload: the defaults shrink
    to fit max_model_len, given lengths that do not fit are a ValueError naming the flags."""
    fitted = fit_lengths([Length("--input-len", input_len, defaults[0]), Length("--output-len", output_len, defaults[1])],
                         max_model_len, f"max_model_len {max_model_len}")
    return (*fitted.values, fitted.notice)


def token_counter(advance: Callable[[int], None]) -> OnStep:
    """An on_step that advances a progress bar by the tokens each step generated."""
    seen: dict[str, int] = {}

    def on_step(states: list) -> None:
        new = 0
        for state in states:
            count = len(state.token_ids)
            new += count - seen.get(state.request_id, 0)
            seen[state.request_id] = count
        advance(new)

    return on_step


@dataclass
class ThroughputResult:
    num_requests: int
    input_tokens: int
    output_tokens: int
    elapsed_s: float
    startup_s: float
    output_throughput: float
    total_throughput: float
    request_throughput: float
    spec_decode: dict | None = None  # acceptance over the timed run (speculative decoding)
    step_timeline: dict | None = None  # StepTimeline.summary() of the timed run, when asked for


def run_throughput(engine, workload: ThroughputWorkload, startup_s: float = 0.0,
                   step_timeline: bool = False, on_step: OnStep | None = None) -> ThroughputResult:
    # Token ids stay below the vocab (only tiny test models have fewer than 10,001 tokens).
    workload = replace(workload, max_token_id=min(workload.max_token_id, engine.core.vocab_size - 1))
    prompts, params = workload.build()
    engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4))  # warm-up
    # A run before this one on the same engine (another window size, say) left these prompts
    # in the prefix cache: its prefill would be free and the number ~25% too high.
    engine.reset_prefix_cache()
    before = engine.spec_decode_stats()
    start = time.perf_counter()
    if step_timeline:  # started inside the timed span, so its steps add up to at most `elapsed`
        engine.core.start_step_timeline()
    outputs = engine.generate(prompts, params, on_step=on_step)
    elapsed = time.perf_counter() - start
    timeline = engine.core.stop_step_timeline() if step_timeline else None
    n_in = sum(len(p) for p in prompts)
    n_out = sum(o["num_tokens_output"] for o in outputs)
    return ThroughputResult(len(prompts), n_in, n_out, elapsed, startup_s, n_out / elapsed,
                            (n_in + n_out) / elapsed, len(prompts) / elapsed, _spec_delta(engine, before), timeline)


def _spec_delta(engine, before: dict) -> dict | None:
    """Acceptance counters gained since `before` (None without speculative decoding)."""
    if engine.config.speculative.method is None:
        return None
    after = engine.spec_decode_stats()
    per_position = [a - (before["accepted_per_position"][i] if i < len(before["accepted_per_position"]) else 0)
                    for i, a in enumerate(after["accepted_per_position"])]
    return {**{k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")},
            "accepted_per_position": per_position}


def _stats(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {"mean": statistics.fmean(values), "median": statistics.median(values), "p99": p99}


@dataclass
class LatencyResult:
    batch_size: int
    input_len: int
    output_len: int
    num_iters: int
    startup_s: float
    ttft_s: dict = field(default_factory=dict)
    e2e_s: dict = field(default_factory=dict)
    tpot_s: float = 0.0  # the median of the runs' TPOTs (0 with output_len 1: no second token)
    output_tokens_per_s: float = 0.0
    spec_decode: dict | None = None  # acceptance over the timed runs (speculative decoding)
    runs: list = field(default_factory=list)  # per timed run: ttft_s, e2e_s, tpot_s


def latency_workload_tokens(batch_size: int, output_len: int, num_iters: int, num_warmup: int) -> int:
    """The tokens run_latency generates in all (warm-ups included): a progress bar's total."""
    return (num_iters + num_warmup) * batch_size * output_len


def run_latency(engine, batch_size: int, input_len: int, output_len: int, num_iters: int = 3,
                num_warmup: int = 1, seed: int = 0, startup_s: float = 0.0,
                prompt_period: int | None = None, on_step: OnStep | None = None) -> LatencyResult:
    if batch_size < 1 or input_len < 1 or output_len < 1 or num_iters < 1 or num_warmup < 0:
        raise ValueError("batch_size, input_len, output_len and num_iters must be >= 1, num_warmup >= 0")
    if prompt_period is not None and not 1 <= prompt_period <= input_len:
        raise ValueError(f"invalid prompt_period={prompt_period}: must be in [1, input_len={input_len}]")
    rng = random.Random(seed)
    max_id = min(10000, engine.core.vocab_size - 1)
    period = prompt_period or input_len

    def timed() -> dict[str, float]:
        # Fresh prompts every run: repeated ones would be prefix-cache hits and skip the prefill.
        motifs = [[rng.randint(0, max_id) for _ in range(period)] for _ in range(batch_size)]
        prompts = [(m * (input_len // period + 1))[:input_len] for m in motifs]
        params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=output_len)
        first_token_at: dict[str, float] = {}

        def seen(states: list) -> None:
            now = time.perf_counter()
            for state in states:
                first_token_at.setdefault(state.request_id, now)
            if on_step is not None:
                on_step(states)

        start = time.perf_counter()
        engine.generate(prompts, params, on_step=seen)
        e2e = time.perf_counter() - start  # after every step, so after every first token
        ttft = max(first_token_at.values()) - start
        return {"ttft_s": ttft, "e2e_s": e2e, "tpot_s": (e2e - ttft) / (output_len - 1) if output_len > 1 else 0.0}

    for _ in range(num_warmup):
        timed()
    before = engine.spec_decode_stats()
    runs = [timed() for _ in range(num_iters)]
    e2es = [r["e2e_s"] for r in runs]
    return LatencyResult(batch_size, input_len, output_len, num_iters, startup_s, _stats([r["ttft_s"] for r in runs]),
                         _stats(e2es), statistics.median(r["tpot_s"] for r in runs),
                         batch_size * output_len / statistics.median(e2es), _spec_delta(engine, before), runs)


def as_json(result) -> dict:
    return asdict(result)
