"""Benchmark sweeps over concurrency or request rate, and the throughput-vs-latency plot.

A *result set* is one line on the plot: the result JSON files of one sweep (one server, one
config), read from a directory or given file by file. Points are ordered by their load
(max_concurrency, else request_rate) and drawn as output throughput against median TPOT and
against median TTFT, so two servers can be compared on one chart.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console

from atom_core.bench.serve_bench import (
    ServeBenchConfig,
    prepare_run,
    report,
    run_benchmark,
    sample_fitting_requests,
    save_result,
)

_PLOT_KEYS = ("output_throughput", "median_tpot_ms", "median_ttft_ms")


@dataclass(frozen=True)
class ResultSet:
    label: str
    results: list[dict[str, Any]]  # ordered by load
    paths: list[Path]


def parse_number_list(spec: str, flag: str, integer: bool) -> list[float] | list[int]:
    """'1,4,16' -> [1, 4, 16]; 'inf' is allowed for rates."""
    values = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        try:
            value = int(item) if integer else float(item)
        except ValueError:
            kind = "integers" if integer else "numbers"
            raise ValueError(f"bad value '{item}' in {flag}; expected comma separated {kind}, e.g. 1,4,16") from None
        if not value > 0:
            raise ValueError(f"{flag} values must be > 0, got {item}")
        values.append(value)
    if not values:
        raise ValueError(f"{flag} is empty")
    return values


def run_sweep(
    cfg: ServeBenchConfig,
    result_dir: str | Path,
    *,
    max_concurrency_list: Sequence[int] | None = None,
    request_rate_list: Sequence[float] | None = None,
    tokenizer: Any = None,
    console: Console | None = None,
) -> list[Path]:
    """One benchmark per concurrency (or rate) on the same prompts; returns the JSON paths written."""
    if (max_concurrency_list is None) == (request_rate_list is None):
        raise ValueError("give exactly one of --max-concurrency-list and --request-rate-list")
    console = console or Console()
    run = prepare_run(cfg, tokenizer)
    # The plot needs median TTFT and TPOT whatever the user selected for the table.
    selected = tuple(dict.fromkeys((*cfg.percentile_metrics, "ttft", "tpot")))
    cfg = replace(cfg, model=run.model_id, tokenizer=run.tokenizer_id, percentile_metrics=selected)
    tokenizer = run.tokenizer
    requests = sample_fitting_requests(run, cfg, console)
    if max_concurrency_list is not None:
        points = [replace(cfg, max_concurrency=int(c)) for c in max_concurrency_list]
    else:
        points = [replace(cfg, request_rate=float(r)) for r in request_rate_list]
    paths = []
    for i, point in enumerate(points, 1):
        console.rule(f"sweep {i}/{len(points)}: max concurrency {point.max_concurrency}, rate {point.request_rate}")
        result = run_benchmark(point, tokenizer=tokenizer, requests=requests, console=console)
        report(result, console)
        paths.append(save_result(result, result_dir))
        console.print(f"saved {paths[-1]}")
    return paths


def _load_key(result: dict[str, Any]) -> float:
    concurrency = result.get("max_concurrency")
    if concurrency is not None:
        return float(concurrency)
    rate = result.get("request_rate", "inf")
    return math.inf if rate == "inf" else float(rate)


def _point_label(result: dict[str, Any], by_concurrency: bool) -> str:
    if by_concurrency:
        return f"c={result['max_concurrency']}"
    rate = result.get("request_rate", "inf")
    return "rate=inf" if rate == "inf" else f"rate={float(rate):g}"


def load_result_set(path: str | Path, label: str | None = None) -> ResultSet:
    """A directory (its *.json result files) or a single result file, as one plot line."""
    path = Path(path)
    if path.is_dir():
        return result_set_from_files(sorted(path.glob("*.json")), label or path.name, skip_other_json=True)
    if path.is_file():
        return result_set_from_files([path], label or path.stem)
    raise ValueError(f"result path '{path}' does not exist")


def result_set_from_files(files: Sequence[Path], label: str, skip_other_json: bool = False) -> ResultSet:
    """Result files as one plot line; `skip_other_json` ignores JSON files that are not results."""
    loaded = []
    for file in map(Path, files):
        try:
            data = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"cannot read result file '{file}': {err}") from err
        if not isinstance(data, dict) or "output_throughput" not in data:
            if skip_other_json:
                continue
            raise ValueError(f"'{file}' is not a benchmark result (no output_throughput)")
        missing = [k for k in _PLOT_KEYS if data.get(k) is None]
        if missing:
            raise ValueError(
                f"result file '{file}' lacks {', '.join(missing)}; rerun with --percentile-metrics including ttft,tpot"
            )
        loaded.append((_load_key(data), file, data))
    if not loaded:
        where = f"'{Path(files[0]).parent}'" if files else "the given paths"
        raise ValueError(f"no benchmark result JSON files in {where}")
    loaded.sort(key=lambda item: item[0])
    return ResultSet(label=label, results=[data for _, _, data in loaded], paths=[file for _, file, _ in loaded])


def plot_result_sets(result_sets: Sequence[ResultSet], output_png: str | Path, title: str | None = None) -> Path:
    """Output throughput vs median TPOT (left) and vs median TTFT (right), one line per set."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state, renders with Agg

    if not result_sets:
        raise ValueError("nothing to plot: no result sets given")
    fig = Figure(figsize=(13, 5.5), dpi=120, layout="constrained")
    ax_tpot, ax_ttft = fig.subplots(1, 2)
    for result_set in result_sets:
        by_concurrency = all(r.get("max_concurrency") is not None for r in result_set.results)
        throughput = [r["output_throughput"] for r in result_set.results]
        for ax, key in ((ax_tpot, "median_tpot_ms"), (ax_ttft, "median_ttft_ms")):
            xs = [r[key] for r in result_set.results]
            (line,) = ax.plot(xs, throughput, marker="o", label=result_set.label)
            for x, y, result in zip(xs, throughput, result_set.results):
                ax.annotate(_point_label(result, by_concurrency), (x, y), textcoords="offset points",
                            xytext=(4, 4), fontsize=8, color=line.get_color())
    ax_tpot.set_xlabel("median TPOT (ms)")
    ax_ttft.set_xlabel("median TTFT (ms)")
    for ax in (ax_tpot, ax_ttft):
        ax.set_ylabel("output throughput (tok/s)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    models = sorted({str(r.get("model_id", "")) for s in result_sets for r in s.results} - {""})
    default_title = "Output throughput vs latency" + (f" - {models[0]}" if len(models) == 1 else "")
    fig.suptitle(title or default_title)
    output_png = Path(output_png)
    output_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output_png, format="png")
    return output_png
