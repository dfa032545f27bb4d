"""Serving metrics exactly as vLLM's benchmark_serving defines them, and their parsing/printing.

Per successful request: TTFT; TPOT = (E2EL - TTFT) / (output_tokens - 1) for requests with more
than one output token; ITL = every gap between token chunks (pooled over all requests); E2EL.
Throughputs divide by the benchmark's wall duration. Goodput counts a request as good when it
meets every given SLO; a request with one output token has TPOT 0 for that purpose (as vLLM).
Failed requests add nothing but an output length of 0.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, Sequence, get_args

import numpy as np
from rich.table import Table

from atom_core.bench.datasets import SampleRequest
from atom_core.bench.serve_client import RequestOutput

PercentileMetric = Literal["ttft", "tpot", "itl", "e2el"]
PERCENTILE_METRICS: tuple[str, ...] = get_args(PercentileMetric)
GOODPUT_METRICS: tuple[str, ...] = ("ttft", "tpot", "e2el")
_HEADERS = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


@dataclass(frozen=True)
class LatencyStats:
    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: tuple[tuple[float, float], ...]  # (p, value)


@dataclass(frozen=True)
class BenchmarkMetrics:
    completed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    latency: dict[str, LatencyStats]  # keyed by "ttft", "tpot", "itl", "e2el"


# --- parsing user specs -----------------------------------------------------------------


def parse_percentile_metrics(spec: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in spec.split(",") if name.strip())
    if not names:
        raise ValueError("--percentile-metrics is empty; expected a comma list of: ttft, tpot, itl, e2el")
    for name in names:
        if name not in PERCENTILE_METRICS:
            raise ValueError(f"unknown percentile metric '{name}'; expected one of: {', '.join(PERCENTILE_METRICS)}")
    return names


def parse_metric_percentiles(spec: str) -> tuple[float, ...]:
    values = []
    for item in (s.strip() for s in spec.split(",")):
        try:
            value = float(item)
        except ValueError:
            raise ValueError(
                f"bad percentile '{item}' in --metric-percentiles; expected numbers like 50,90,99"
            ) from None
        if not 0.0 <= value <= 100.0:
            raise ValueError(f"percentile {item} is out of range; expected 0 to 100")
        values.append(value)
    return tuple(values)


def parse_goodput(spec: str | Sequence[str] | None) -> dict[str, float]:
    """'ttft:200 tpot:50' (or a list of 'KEY:VALUE' items, or comma separated) -> {'ttft': 200.0, ...} in ms."""
    if not spec:
        return {}
    items = [spec] if isinstance(spec, str) else list(spec)
    pairs = [p for item in items for p in re.split(r"[\s,]+", item.strip()) if p]
    slos: dict[str, float] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        try:
            if not sep:
                raise ValueError
            slos[name] = float(value)
        except ValueError:
            raise ValueError(
                f"bad --goodput item '{pair}'; expected KEY:VALUE with KEY in ttft, tpot, e2el and VALUE in ms"
            ) from None
        if name not in GOODPUT_METRICS:
            raise ValueError(f"unknown --goodput metric '{name}'; expected one of: {', '.join(GOODPUT_METRICS)}")
        if slos[name] < 0:
            raise ValueError(f"--goodput {name} must be >= 0 ms, got {value}")
    return slos


# --- computing --------------------------------------------------------------------------


def _stats(values_s: list[float], percentiles: Sequence[float]) -> LatencyStats:
    arr = np.asarray(values_s or [0.0], dtype=np.float64) * 1000.0
    return LatencyStats(
        mean_ms=float(np.mean(arr)),
        median_ms=float(np.median(arr)),
        std_ms=float(np.std(arr)),
        percentiles_ms=tuple((float(p), float(np.percentile(arr, p))) for p in percentiles),
    )


def count_output_tokens(output: RequestOutput, tokenizer: Any) -> int:
    """The server's usage count when it sent one, else the generated text re-tokenized."""
    if output.output_tokens:
        return int(output.output_tokens)
    if tokenizer is None:
        raise ValueError("the server sent no usage counts, so a tokenizer is needed to count output tokens")
    return len(tokenizer(output.generated_text, add_special_tokens=False).input_ids)


def calculate_metrics(
    input_requests: Sequence[SampleRequest],
    outputs: Sequence[RequestOutput],
    duration_s: float,
    tokenizer: Any,
    percentiles: Sequence[float] = (99.0,),
    goodput: dict[str, float] | None = None,
) -> tuple[BenchmarkMetrics, list[int]]:
    """Returns the metrics and each request's output length (0 for failed requests)."""
    assert len(input_requests) == len(outputs), "one output per input request"
    output_lens: list[int] = []
    total_input = completed = 0
    ttfts: list[float] = []
    tpots: list[float] = []
    all_tpots: list[float] = []
    itls: list[float] = []
    e2els: list[float] = []
    for request, output in zip(input_requests, outputs):
        if not output.success:
            output_lens.append(0)
            continue
        output_len = count_output_tokens(output, tokenizer)
        output_lens.append(output_len)
        total_input += request.prompt_len
        tpot = 0.0
        if output_len > 1:
            tpot = (output.latency - output.ttft) / (output_len - 1)
            tpots.append(tpot)
        all_tpots.append(tpot)
        itls += output.itl
        ttfts.append(output.ttft)
        e2els.append(output.latency)
        completed += 1
    good = _count_good(goodput or {}, {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els})
    total_output = sum(output_lens)
    metrics = BenchmarkMetrics(
        completed=completed,
        total_input=total_input,
        total_output=total_output,
        request_throughput=completed / duration_s,
        request_goodput=good / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        latency={
            "ttft": _stats(ttfts, percentiles),
            "tpot": _stats(tpots, percentiles),
            "itl": _stats(itls, percentiles),
            "e2el": _stats(e2els, percentiles),
        },
    )
    return metrics, output_lens


def _count_good(slos_ms: dict[str, float], per_request_s: dict[str, list[float]]) -> int:
    if not slos_ms:
        return 0
    names = list(slos_ms)
    rows = zip(*(per_request_s[name] for name in names))
    return sum(all(value * 1000.0 <= slos_ms[name] for name, value in zip(names, row)) for row in rows)


def throughput_result(metrics: BenchmarkMetrics, has_goodput: bool) -> dict[str, Any]:
    """The count and throughput keys of vLLM's result dict (goodput is None without SLOs)."""
    return {
        "completed": metrics.completed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput if has_goodput else None,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
    }


def latency_result(metrics: BenchmarkMetrics, selected_metrics: Sequence[str]) -> dict[str, Any]:
    """mean_/median_/std_/p{N}_{metric}_ms keys for each selected metric, in vLLM's order."""
    result: dict[str, Any] = {}
    for name in PERCENTILE_METRICS:
        if name not in selected_metrics:
            continue
        stats = metrics.latency[name]
        result[f"mean_{name}_ms"] = stats.mean_ms
        result[f"median_{name}_ms"] = stats.median_ms
        result[f"std_{name}_ms"] = stats.std_ms
        for p, value in stats.percentiles_ms:
            result[f"p{percentile_word(p)}_{name}_ms"] = value
    return result


def percentile_word(p: float) -> str:
    """99.0 -> '99', 99.9 -> '99.9' (vLLM's key spelling)."""
    return str(int(p)) if int(p) == p else str(p)


# --- printing ---------------------------------------------------------------------------


def result_table(result: dict[str, Any]) -> Table:
    """The vLLM summary as a rich table, read from a result dict."""
    table = Table(title="Serving Benchmark Result", show_header=False, title_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    num_prompts = result.get("num_prompts", len(result.get("errors", [])))
    failed = num_prompts - result["completed"]
    table.add_row("Successful requests", str(result["completed"]))
    table.add_row("Failed requests", f"[bold red]{failed}[/]" if failed else "0")
    table.add_row("Benchmark duration (s)", f"{result['duration']:.2f}")
    table.add_row("Total input tokens", str(result["total_input_tokens"]))
    table.add_row("Total generated tokens", str(result["total_output_tokens"]))
    table.add_row("Request throughput (req/s)", f"{result['request_throughput']:.2f}")
    if result.get("request_goodput") is not None:
        table.add_row("Request goodput (req/s)", f"{result['request_goodput']:.2f}")
    table.add_row("Output token throughput (tok/s)", f"{result['output_throughput']:.2f}")
    table.add_row("Total token throughput (tok/s)", f"{result['total_token_throughput']:.2f}")
    for name in PERCENTILE_METRICS:
        keys = [k for k in result if k.endswith(f"_{name}_ms") and not k.startswith(("mean", "median", "std"))]
        if f"mean_{name}_ms" not in result:
            continue
        table.add_section()
        table.add_row(f"[bold]{_HEADERS[name]}[/]", "")
        upper = name.upper()
        table.add_row(f"Mean {upper} (ms)", f"{result[f'mean_{name}_ms']:.2f}")
        table.add_row(f"Median {upper} (ms)", f"{result[f'median_{name}_ms']:.2f}")
        table.add_row(f"Std {upper} (ms)", f"{result[f'std_{name}_ms']:.2f}")
        for key in keys:
            table.add_row(f"{key.split('_')[0].upper()} {upper} (ms)", f"{result[key]:.2f}")
    return table
