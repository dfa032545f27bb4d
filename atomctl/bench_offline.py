"""`atomctl bench offline` and `atomctl bench latency`: engine benchmarks without a server."""
import json
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from atomctl.engine_options import engine_kwargs, with_engine_options
from atomctl.errors import friendly_errors


def _start_engine(engine_args: dict, console: Console):
    from atom_core import LLMEngine

    start = time.perf_counter()
    with console.status("starting the engine (load, KV sizing, compile, graph capture)"):
        engine = LLMEngine(**engine_kwargs(engine_args))
    return engine, time.perf_counter() - start


def _progress(console: Console, label: str, total: int, disable: bool):
    """bench serve's bar, counting output tokens (atom_core/bench/progress.py)."""
    from atom_core.bench.progress import progress_bar

    return progress_bar(console, label, total, enabled=not disable)


_DISABLE_TQDM = typer.Option(False, "--disable-tqdm", help="No progress bar.")


def _startup_phases(engine, startup: float) -> dict[str, float]:
    """The runner's phases plus `other`: the rest of engine construction (config and tokenizer
    loading, CUDA context, the scheduler), so the phases add up to start to ready."""
    phases = dict(engine.core.executor.startup_breakdown)
    phases["other"] = max(0.0, startup - sum(phases.values()))
    return phases


def _model_rows(engine) -> list[tuple[str, str]]:
    """The weight format, weight bytes and KV bytes per token (rank 0 under tensor parallelism)."""
    s = engine.core.executor.runner.model_summary
    return [("weight format", s["format"]), ("weights (GiB, per rank)", f"{s['weight_bytes'] / (1 << 30):.2f}"),
            ("KV cache bytes/token (per rank)", f"{s['kv_bytes_per_token']:,}")]


def _breakdown(phases: dict[str, float]) -> str:
    return ", ".join(f"{name.replace('_', ' ')} {seconds:.1f}" for name, seconds in phases.items())


def _spec_rows(stats: dict | None) -> list[tuple[str, str]]:
    """Acceptance rate and mean accepted length of the timed runs (speculative decoding only)."""
    if stats is None:
        return []
    drafts, proposed, accepted = stats["num_drafts"], stats["num_draft_tokens"], stats["num_accepted_tokens"]
    return [("spec decode acceptance rate", f"{accepted / proposed:.1%}" if proposed else "no drafts"),
            ("spec decode mean accepted length", f"{1 + accepted / drafts:.2f}" if drafts else "no drafts")]


def _show(title: str, rows: list[tuple[str, str]], output_json: Optional[Path], data: dict) -> None:
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)
    if output_json is not None:
        output_json.parent.mkdir(parents=True, exist_ok=True)
        output_json.write_text(json.dumps(data, indent=2))


@friendly_errors
@with_engine_options
def offline_cmd(
    num_prompts: int = typer.Option(256, help="Requests in the workload."),
    min_input_len: Optional[int] = typer.Option(None, help="Shortest prompt (default 100, at most the longest)."),
    max_input_len: Optional[int] = typer.Option(
        None, help="Longest prompt (default 1024; with --max-output-len's default shrunk, in proportion, to fit "
                   "the model's max_model_len, with a notice)."),
    min_output_len: Optional[int] = typer.Option(None, help="Fewest output tokens (default 100, at most the most)."),
    max_output_len: Optional[int] = typer.Option(None, help="Most output tokens (default 1024, fitted as --max-input-len)."),
    temperature: float = typer.Option(0.6),
    workload_seed: int = typer.Option(0, help="random.seed of the workload (nano-vllm: 0)."),
    output_json: Optional[Path] = typer.Option(None, help="Write the result as JSON."),
    step_timeline: bool = typer.Option(False, "--step-timeline/--no-step-timeline",
                                       help="Also report where the time went: steps with prompt tokens vs "
                                            "decode-only steps, and decode-only steps by batch size."),
    disable_tqdm: bool = _DISABLE_TQDM,
    engine_args: dict = None,
):
    """Offline throughput: nano-vllm's workload by default (256 requests, lengths in [100, 1024])."""
    from atom_core.bench.offline import as_json, fit_workload, run_throughput, token_counter

    console = Console()
    lengths = dict(num_prompts=num_prompts, min_input_len=min_input_len, max_input_len=max_input_len,
                   min_output_len=min_output_len, max_output_len=max_output_len, temperature=temperature,
                   seed=workload_seed)
    if engine_args.get("data_parallel_size", 1) > 1:
        if step_timeline:  # each replica's core runs in its own process, out of this one's reach
            raise ValueError(f"--step-timeline records one engine core's steps; it does not support "
                             f"--data-parallel-size {engine_args['data_parallel_size']} (run it with -dp 1)")
        return _offline_replicas(lengths, engine_args, output_json, console)
    fit_workload(1 << 62, **lengths)  # bad ranges fail before the engine starts
    engine, startup = _start_engine(engine_args, console)
    workload, notice = fit_workload(engine.max_model_len, **lengths)
    if notice:
        console.print(notice, style="yellow", highlight=False)
    total = sum(p.max_tokens for p in workload.build()[1])  # ignore_eos: every request runs to max_tokens
    with _progress(console, "output tokens", total, disable_tqdm) as advance:
        result = run_throughput(engine, workload, startup, step_timeline, on_step=token_counter(advance))
    phases = _startup_phases(engine, startup)
    _show("atomctl bench offline", [
        *_throughput_rows(result),
        *_spec_rows(result.spec_decode),
        ("start to ready (s)", f"{result.startup_s:.1f}"),
        ("  of which (s)", _breakdown(phases)),
        *_model_rows(engine),
    ], output_json, {"workload": as_json(workload), **as_json(result), "engine_args": engine_kwargs(engine_args),
                     "startup_breakdown_s": phases, "model": engine.core.executor.runner.model_summary})
    if result.step_timeline is not None:
        _show_step_timeline(result.step_timeline, result.elapsed_s)


def _show_step_timeline(summary: dict, elapsed_s: float) -> None:
    """Steps with prompt tokens vs decode-only steps, then decode-only steps by batch size; each
    with its share of the timed run (the total falls short of 100% by what followed the last step)."""
    columns = ("steps", "seconds", "share of run", "ms per step", "mean batch")
    decode = summary["decode_only"]  # multi-step windows: a decode-only step runs several forwards
    windows = f"decode windows: {decode['forwards']:,} forwards in {decode['steps']:,} decode-only steps"
    kinds = Table(title="step timeline", caption=windows if decode["forwards"] != decode["steps"] else None)
    by_batch = Table(title="decode-only steps by batch size")
    for table, first in ((kinds, "kind"), (by_batch, "batch")):
        table.add_column(first)
        for name in columns:
            table.add_column(name, justify="right")
    kinds.add_column("prompt tokens", justify="right")
    by_batch.add_column("forwards", justify="right")

    def cells(row: dict) -> list[str]:
        return [f"{row['steps']:,}", f"{row['seconds']:.2f}", f"{row['seconds'] / elapsed_s:.1%}",
                f"{row['mean_ms_per_step']:.2f}", f"{row['mean_decodes_per_step']:.1f}"]

    for kind in ("with_prompt", "decode_only", "total"):
        kinds.add_row(kind.replace("_", " "), *cells(summary[kind]), f"{summary[kind]['prompt_tokens']:,}")
    for row in summary["decode_only_by_batch"]:
        if row["steps"]:
            by_batch.add_row(row["batch"], *cells(row), f"{row['forwards']:,}")
    Console().print(kinds)
    Console().print(by_batch)


def _throughput_rows(result) -> list[tuple[str, str]]:
    return [("requests", f"{result.num_requests}"), ("input tokens", f"{result.input_tokens}"),
            ("output tokens", f"{result.output_tokens}"), ("elapsed (s)", f"{result.elapsed_s:.2f}"),
            ("output tok/s", f"{result.output_throughput:,.0f}"), ("total tok/s", f"{result.total_throughput:,.0f}"),
            ("requests/s", f"{result.request_throughput:.2f}")]


def _offline_replicas(lengths: dict, engine_args: dict, output_json: Optional[Path], console: Console) -> None:
    """-dp N: the workload through N engine cores behind the serving balancer (atom_core/bench/offline_dp.py)."""
    from atom_core.bench.offline import as_json, fit_workload
    from atom_core.bench.offline_dp import run_throughput_replicas
    from atom_core.config import EngineConfig
    from atom_core.loader import resolve_model, resolve_model_files

    kwargs = engine_kwargs(engine_args)
    config = EngineConfig.from_kwargs(kwargs.pop("model"), **kwargs)
    max_model_len = resolve_model(config.model, resolve_model_files(config.model.model, config.model.tokenizer)).max_model_len
    workload, notice = fit_workload(max_model_len, **lengths)
    if notice:
        console.print(notice, style="yellow", highlight=False)
    with console.status(f"running {workload.num_prompts} requests over {config.parallel.data_parallel_size} replicas"):
        result, split = run_throughput_replicas(config, workload)
    replicas = config.parallel.data_parallel_size
    _show(f"atomctl bench offline ({replicas} data-parallel replicas)", [
        *_throughput_rows(result),
        ("requests per replica", " / ".join(str(n) for n in split["requests_per_replica"])),
        ("start to ready (s)", f"{result.startup_s:.1f}"),
    ], output_json, {"workload": as_json(workload), **as_json(result), **split,
                     "engine_args": engine_kwargs(engine_args)})


@friendly_errors
@with_engine_options
def latency_cmd(
    batch_size: int = typer.Option(1, "--batch-size", "--bs"),
    input_len: Optional[int] = typer.Option(
        None, help="Prompt tokens (default 128; with --output-len's default shrunk, in proportion, to fit the "
                   "model's max_model_len, with a notice)."),
    output_len: Optional[int] = typer.Option(None, help="Output tokens per request (default 256, fitted as --input-len)."),
    num_iters: int = typer.Option(3, help="Timed iterations (medians reported)."),
    num_iters_warmup: int = typer.Option(1),
    prompt_period: Optional[int] = typer.Option(None, help="Repeat a random motif of this many tokens to fill each prompt (a repetitive workload, e.g. for --method ngram)."),
    output_json: Optional[Path] = typer.Option(None, help="Write the result as JSON."),
    disable_tqdm: bool = _DISABLE_TQDM,
    engine_args: dict = None,
):
    """Latency at a fixed batch: TTFT, TPOT, end-to-end and tokens/s (greedy, ignore_eos), all from the same runs."""
    from atom_core.bench.offline import as_json, fit_latency_lengths, latency_workload_tokens, run_latency, token_counter

    given = [v for v in (input_len, output_len) if v is not None]
    if min(batch_size, num_iters, *given) < 1 or num_iters_warmup < 0:
        raise ValueError("--batch-size, --input-len, --output-len and --num-iters must be >= 1")
    console = Console()
    engine, startup = _start_engine(engine_args, console)
    input_len, output_len, notice = fit_latency_lengths(engine.max_model_len, input_len, output_len)
    if notice:
        console.print(notice, style="yellow", highlight=False)
    total = latency_workload_tokens(batch_size, output_len, num_iters, num_iters_warmup)
    with _progress(console, f"{num_iters_warmup} warm-up + {num_iters} timed runs, output tokens", total,
                   disable_tqdm) as advance:
        r = run_latency(engine, batch_size, input_len, output_len, num_iters, num_iters_warmup, startup_s=startup,
                        prompt_period=prompt_period, on_step=token_counter(advance))
    phases = _startup_phases(engine, startup)
    ms = lambda s: f"{s * 1000:.2f}"  # noqa: E731
    _show(f"atomctl bench latency (bs={batch_size}, in={input_len}, out={output_len})", [
        ("TTFT ms mean / median / p99", f"{ms(r.ttft_s['mean'])} / {ms(r.ttft_s['median'])} / {ms(r.ttft_s['p99'])}"),
        ("TPOT ms", ms(r.tpot_s)),
        ("end-to-end ms mean / median / p99", f"{ms(r.e2e_s['mean'])} / {ms(r.e2e_s['median'])} / {ms(r.e2e_s['p99'])}"),
        ("output tok/s", f"{r.output_tokens_per_s:,.1f}"),
        *_spec_rows(r.spec_decode),
        ("start to ready (s)", f"{r.startup_s:.1f}"),
        ("  of which (s)", _breakdown(phases)),
        *_model_rows(engine),
    ], output_json, {**as_json(r), "engine_args": engine_kwargs(engine_args), "startup_breakdown_s": phases,
                     "model": engine.core.executor.runner.model_summary})


def register(bench_app: typer.Typer) -> None:
    bench_app.command("offline")(offline_cmd)
    bench_app.command("latency")(latency_cmd)
