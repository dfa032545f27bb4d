"""`atomctl bench serve | sweep | plot`: the online serving benchmark (options as vLLM's benchmark_serving).

Thin: options -> ServeBenchConfig -> atom_core.bench. `serve` and `sweep` share one option
table (`_SERVE_OPTIONS`), added to both commands' signatures by `_with_serve_options`.
"""
from __future__ import annotations

import functools
import inspect
import math
import re
import typing
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, List, Optional

import typer
from rich.console import Console

from atom_core.bench.names import BACKENDS, DATASET_NAMES
from atomctl.errors import friendly_errors

if TYPE_CHECKING:  # the benchmark itself (numpy, httpx) is imported by the commands: --help stays fast
    from atom_core.bench.serve_bench import ServeBenchConfig

bench_app = typer.Typer(
    help="Benchmarks: online serving against any OpenAI-compatible server (serve, sweep, plot); the engine offline.",
    no_args_is_help=True,
    rich_markup_mode=None,  # plain click help, as atomctl's: readable at 80 columns
)

def _option(name: str, type_: Any, default: Any, help: str, *flags: str) -> tuple[str, Any, Any]:
    """One shared option: (parameter name, annotation carrying its typer.Option, default)."""
    return name, Annotated[type_, typer.Option(*flags, help=help)], default


_OptStr, _OptInt, _OptFloat, _OptList = Optional[str], Optional[int], Optional[float], Optional[List[str]]

# Flag names follow vLLM's benchmark_serving, so existing command lines keep working.
_SERVE_OPTIONS: list[tuple[str, Any, Any]] = [
    _option("backend", str, "vllm",
            f"One of: {', '.join(BACKENDS)} (openai/vllm/atom: completions API; openai-chat: chat API)."),
    _option("base_url", _OptStr, None, "Server root, e.g. http://host:8000; overrides --host/--port."),
    _option("host", str, "127.0.0.1", "Server host (when no --base-url)."),
    _option("port", int, 8000, "Server port (when no --base-url)."),
    _option("endpoint", _OptStr, None,
            "API path; default /v1/completions, /v1/chat/completions for openai-chat, /generate_stream for tgi."),
    _option("model", _OptStr, None, "Model name; default: the first model at /v1/models."),
    _option("served_model_name", _OptStr, None, "Model name sent in requests, if not --model."),
    _option("lora_modules", _OptStr, None,
            "Comma-separated LoRA adapter names the server serves: request i names the (i mod n)-th as its model."),
    _option("tokenizer", _OptStr, None,
            "Tokenizer directory, 'demo', preset:NAME or a hub id in the local HF cache (hubs are never asked); "
            "default: the server's /v1/models root, else the model name."),
    _option("trust_remote_code", bool, False, "Trust remote code when loading the tokenizer.", "--trust-remote-code"),
    _option("seed", int, 0, "Seed for prompts and arrival times."),
    _option("dataset_name", str, "random", f"One of: {', '.join(DATASET_NAMES)}."),
    _option("dataset_path", _OptStr, None, "ShareGPT JSON or custom JSONL file."),
    _option("random_input_len", _OptInt, None,
            "random: prompt tokens (as the server counts them); default 1024, with --random-output-len's default "
            "shrunk in proportion to fit the server's max_model_len (with a notice)."),
    _option("random_output_len", _OptInt, None, "random: max output tokens; default 128, fitted as --random-input-len."),
    _option("random_range_ratio", float, 0.0, "random: lengths uniform in [X*(1-r), X*(1+r)]."),
    _option("random_prefix_len", int, 0, "random: tokens of a prefix shared by all prompts."),
    _option("apply_chat_template", bool, False,
            "random/custom: wrap prompts in the tokenizer's chat template (for completions backends).",
            "--apply-chat-template", "--use-chat-template"),
    _option("sharegpt_output_len", _OptInt, None, "sharegpt: fixed output length instead of the reply's."),
    _option("custom_output_len", int, 256, "custom: output length for lines without output_len."),
    _option("prefix_repetition_prefix_len", int, 256, "prefix-repetition: shared prefix tokens."),
    _option("prefix_repetition_suffix_len", int, 256, "prefix-repetition: unique suffix tokens."),
    _option("prefix_repetition_num_prefixes", int, 10, "prefix-repetition: number of distinct prefixes."),
    _option("prefix_repetition_output_len", int, 128, "prefix-repetition: output tokens."),
    _option("random_mm_base_items_per_request", int, 1, "random-mm: images per request (vLLM's flag)."),
    _option("random_mm_num_mm_items_range_ratio", float, 0.0, "random-mm: the image count uniform in [N*(1-r), N*(1+r)]."),
    _option("random_mm_limit_mm_per_prompt", _OptStr, None, 'random-mm: at most this many images, \'{"image": K}\'.'),
    _option("random_mm_bucket_config", str, "{(256, 256, 1): 0.5, (720, 1280, 1): 0.5}",
            "random-mm: {(height, width, 1): probability, ...} of the image sizes (vLLM's format)."),
    _option("num_prompts", int, 1000, "Number of prompts to send."),
    _option("request_rate", float, math.inf, "Requests per second, or inf to send all at once."),
    _option("burstiness", float, 1.0, "Gamma shape of inter-arrival times; 1 = Poisson, lower = burstier."),
    _option("max_concurrency", _OptInt, None, "At most this many requests in flight."),
    _option("ignore_eos", bool, False, "Send ignore_eos so every request generates its full length.", "--ignore-eos"),
    _option("num_warmups", int, 0, "Warm-up requests before the timed run."),
    _option("percentile_metrics", str, "ttft,tpot,itl", "Comma list of ttft,tpot,itl,e2el to report."),
    _option("metric_percentiles", str, "99", "Comma list of percentiles, e.g. 50,90,99."),
    _option("goodput", _OptList, None, "SLOs in ms, e.g. --goodput ttft:200 tpot:50 (or quoted / repeated)."),
    _option("temperature", _OptFloat, None, "Sampling temperature (default greedy)."),
    _option("top_p", _OptFloat, None, "Sampling top-p."),
    _option("top_k", _OptInt, None, "Sampling top-k."),
    _option("profile", bool, False, "POST /start_profile and /stop_profile around the run.", "--profile"),
    _option("disable_tqdm", bool, False, "No progress bar.", "--disable-tqdm"),
    _option("request_timeout", float, 6 * 3600.0, "Per-request timeout in seconds."),
    _option("metadata", _OptList, None, "KEY=VALUE to record in the result JSON (repeatable)."),
]
_SERVE_NAMES = [name for name, _, _ in _SERVE_OPTIONS]
_SLO_ITEM = re.compile(r"^[A-Za-z_]+:[-+0-9.eE]+$")


def _with_serve_options(command: Callable[..., None]) -> Callable[..., None]:
    """Give `command(ctx, cfg, ...own options)` the shared options; it receives a built ServeBenchConfig.

    Errors become one line and exit 1 (atomctl.errors.friendly_errors; --debug shows tracebacks)."""
    own = inspect.signature(command)
    # cfg's type is imported for type checkers only; the wrapper drops that parameter anyway.
    own_hints = typing.get_type_hints(command, localns={"ServeBenchConfig": Any}, include_extras=True)
    own_params = [
        p.replace(annotation=own_hints.get(p.name, p.annotation)) for p in own.parameters.values() if p.name != "cfg"
    ]
    shared = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=default)
        for name, annotation, default in _SERVE_OPTIONS
    ]
    params = own_params + shared
    params.sort(key=lambda p: p.kind)

    def run(ctx: typer.Context, **kwargs: Any) -> None:
        options = {name: kwargs.pop(name) for name in _SERVE_NAMES}
        command(ctx=ctx, cfg=_build_config(ctx, options), **kwargs)

    wrapper = functools.update_wrapper(friendly_errors(run), command)
    wrapper.__signature__ = own.replace(parameters=params)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper


def _build_config(ctx: typer.Context, o: dict[str, Any]) -> ServeBenchConfig:
    from atom_core.bench.datasets import DatasetConfig
    from atom_core.bench.serve_bench import ServeBenchConfig

    goodput = list(o["goodput"] or [])
    extra = list(ctx.args)
    # vLLM spells --goodput with nargs="+": `--goodput ttft:200 tpot:50` leaves tpot:50 as an extra argument.
    if extra and goodput and all(_SLO_ITEM.match(a) for a in extra):
        goodput += extra
        extra = []
    if extra:
        raise ValueError(f"unexpected argument(s): {' '.join(extra)}")
    dataset = DatasetConfig(
        name=o["dataset_name"], path=o["dataset_path"],
        random_input_len=o["random_input_len"], random_output_len=o["random_output_len"],
        random_range_ratio=o["random_range_ratio"], random_prefix_len=o["random_prefix_len"],
        apply_chat_template=o["apply_chat_template"], sharegpt_output_len=o["sharegpt_output_len"],
        custom_output_len=o["custom_output_len"],
        prefix_repetition_prefix_len=o["prefix_repetition_prefix_len"],
        prefix_repetition_suffix_len=o["prefix_repetition_suffix_len"],
        prefix_repetition_num_prefixes=o["prefix_repetition_num_prefixes"],
        prefix_repetition_output_len=o["prefix_repetition_output_len"],
        random_mm_base_items_per_request=o["random_mm_base_items_per_request"],
        random_mm_num_mm_items_range_ratio=o["random_mm_num_mm_items_range_ratio"],
        random_mm_limit_mm_per_prompt=o["random_mm_limit_mm_per_prompt"],
        random_mm_bucket_config=o["random_mm_bucket_config"],
    )
    sampling = {"temperature": o["temperature"], "top_p": o["top_p"], "top_k": o["top_k"]}
    return ServeBenchConfig(
        base_url=o["base_url"] or f"http://{o['host']}:{o['port']}",
        backend=o["backend"], endpoint=o["endpoint"], model=o["model"],
        served_model_name=o["served_model_name"], tokenizer=o["tokenizer"],
        trust_remote_code=o["trust_remote_code"], dataset=dataset, num_prompts=o["num_prompts"],
        request_rate=o["request_rate"], burstiness=o["burstiness"], max_concurrency=o["max_concurrency"],
        seed=o["seed"], ignore_eos=o["ignore_eos"], num_warmups=o["num_warmups"],
        percentile_metrics=o["percentile_metrics"], metric_percentiles=o["metric_percentiles"],
        goodput=" ".join(goodput), profile=o["profile"], show_progress=not o["disable_tqdm"],
        request_timeout_s=o["request_timeout"],
        lora_modules=tuple(n.strip() for n in (o["lora_modules"] or "").split(",") if n.strip()),
        extra_body={k: v for k, v in sampling.items() if v is not None},
        metadata=_parse_metadata(o["metadata"]),
    )


def _parse_metadata(items: list[str] | None) -> dict[str, str]:
    metadata = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"bad --metadata '{item}'; expected KEY=VALUE")
        metadata[key] = value
    return metadata


_EXTRA_ARGS = {"allow_extra_args": True}


@bench_app.command("serve", context_settings=_EXTRA_ARGS)
@_with_serve_options
def serve(
    ctx: typer.Context,
    cfg: ServeBenchConfig,
    save_result: Annotated[bool, typer.Option("--save-result", help="Write the result JSON.")] = False,
    result_dir: Annotated[Optional[Path], typer.Option(help="Directory for the result JSON (default: .).")] = None,
    result_filename: Annotated[
        Optional[str], typer.Option(help="File name (default: vLLM's {backend}-{rate}qps-...json).")
    ] = None,
) -> None:
    """Benchmark an online server: TTFT, TPOT, ITL, E2EL, throughput, goodput."""
    from atom_core.bench import serve_bench
    from atom_core.bench.serve_bench import report, run_benchmark

    console = Console()
    result = run_benchmark(cfg, console=console)
    report(result, console)
    if save_result or result_dir or result_filename:
        path = serve_bench.save_result(result, result_dir, result_filename)
        console.print(f"saved {path}")


@bench_app.command("sweep", context_settings=_EXTRA_ARGS)
@_with_serve_options
def sweep(
    ctx: typer.Context,
    cfg: ServeBenchConfig,
    max_concurrency_list: Annotated[Optional[str], typer.Option(help="Concurrencies to run, e.g. 1,4,16.")] = None,
    request_rate_list: Annotated[Optional[str], typer.Option(help="Request rates to run, e.g. 1,2,4,inf.")] = None,
    result_dir: Annotated[
        Optional[Path], typer.Option(help="Where the JSONs and the PNG go (default bench_results/sweep-DATE).")
    ] = None,
    label: Annotated[Optional[str], typer.Option(help="Legend label of this sweep (default: result dir name).")] = None,
    compare: Annotated[
        Optional[List[Path]], typer.Option(help="Earlier results (dir or JSON file) to plot alongside; repeatable.")
    ] = None,
    plot_path: Annotated[Optional[Path], typer.Option(help="PNG path (default RESULT_DIR/sweep.png).")] = None,
) -> None:
    """Run the benchmark at several concurrencies (or rates); write each JSON and a throughput-latency PNG."""
    from atom_core.bench.sweep import load_result_set, parse_number_list, plot_result_sets, result_set_from_files, run_sweep

    if (max_concurrency_list is None) == (request_rate_list is None):
        raise ValueError("give exactly one of --max-concurrency-list and --request-rate-list")
    concurrencies = rates = None
    if max_concurrency_list:
        concurrencies = parse_number_list(max_concurrency_list, "--max-concurrency-list", integer=True)
    else:
        rates = parse_number_list(request_rate_list, "--request-rate-list", integer=False)
    others = [load_result_set(p) for p in compare or []]  # fail on a bad path before the long run
    result_dir = result_dir or Path("bench_results") / f"sweep-{datetime.now():%Y%m%d-%H%M%S}"
    console = Console()
    paths = run_sweep(cfg, result_dir, max_concurrency_list=concurrencies, request_rate_list=rates, console=console)
    ours = result_set_from_files(paths, label or result_dir.name)
    png = plot_result_sets([ours, *others], plot_path or result_dir / "sweep.png")
    console.print(f"plot: {png}")


@bench_app.command("plot")
@friendly_errors
def plot(
    paths: Annotated[List[Path], typer.Argument(help="Result dirs or JSON files; each one is a line.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="PNG to write.")] = Path("sweep.png"),
    label: Annotated[Optional[List[str]], typer.Option(help="Legend labels, one per path, in order.")] = None,
    title: Annotated[Optional[str], typer.Option(help="Chart title.")] = None,
) -> None:
    """Plot output throughput vs median TPOT and TTFT from existing result files."""
    from atom_core.bench.sweep import load_result_set, plot_result_sets

    labels = list(label or [])
    if labels and len(labels) != len(paths):
        raise ValueError(f"got {len(labels)} --label values for {len(paths)} paths")
    sets = [load_result_set(p, labels[i] if labels else None) for i, p in enumerate(paths)]
    typer.echo(f"plot: {plot_result_sets(sets, output, title)}")
