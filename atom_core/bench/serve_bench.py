"""The online serving benchmark: send prompts at a rate, measure, and build vLLM's result dict.

`run_benchmark(cfg)` is the whole thing as one call (tokenizer, prompts, warm-ups, run,
metrics); `benchmark(...)` is the async run on prompts you already have.

Load shape, as vLLM: requests start at gamma-distributed inter-arrival times (shape =
burstiness, mean = 1 / request_rate; burstiness 1 is a Poisson process), all at once when the
rate is inf; at most `max_concurrency` are in flight (a request that arrives while the limit is
reached waits, and its wait is not part of its TTFT). Arrival times are drawn from the seed and
kept on an absolute schedule, so slow event-loop turns do not stretch the run.
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

import httpx
import numpy as np
from rich.console import Console

from atom_core.bench.datasets import DatasetConfig, SampleRequest, check_fit, fit_to_model, sample_requests
from atom_core.bench.progress import progress_bar
from atom_core.bench.serve_client import (
    BACKENDS,
    REQUEST_FUNCS,
    RequestInput,
    RequestOutput,
    auth_headers,
    check_endpoint,
    default_endpoint,
)
from atom_core.bench.serve_metrics import (
    calculate_metrics,
    latency_result,
    parse_goodput,
    parse_metric_percentiles,
    parse_percentile_metrics,
    result_table,
    throughput_result,
)

@dataclass(frozen=True)
class ServeBenchConfig:
    """Everything one benchmark run needs; validated on construction.

    `base_url` is the server root (no /v1); `model` None asks the server's /v1/models.
    `goodput` is {metric: slo_ms}; `percentile_metrics`/`metric_percentiles` may also be given
    as vLLM's strings ("ttft,tpot,itl", "50,99").
    """

    base_url: str = "http://127.0.0.1:8000"
    backend: str = "vllm"
    endpoint: str | None = None
    model: str | None = None
    served_model_name: str | None = None
    tokenizer: str | None = None
    trust_remote_code: bool = False
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    num_prompts: int = 1000
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = False
    num_warmups: int = 0
    initial_test: bool = True
    percentile_metrics: tuple[str, ...] | str = ("ttft", "tpot", "itl")
    metric_percentiles: tuple[float, ...] | str = (99.0,)
    goodput: dict[str, float] | str | None = None
    profile: bool = False
    show_progress: bool = True
    request_timeout_s: float = 6 * 3600.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    lora_modules: tuple[str, ...] = ()  # LoRA adapter names: request i names lora_modules[i % n] as its model
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Accept vLLM's string spellings; store the parsed forms.
        if isinstance(self.percentile_metrics, str):
            object.__setattr__(self, "percentile_metrics", parse_percentile_metrics(self.percentile_metrics))
        if isinstance(self.metric_percentiles, str):
            object.__setattr__(self, "metric_percentiles", parse_metric_percentiles(self.metric_percentiles))
        if self.goodput is None or isinstance(self.goodput, str):
            object.__setattr__(self, "goodput", parse_goodput(self.goodput))
        if self.endpoint is None:
            object.__setattr__(self, "endpoint", default_endpoint(self.backend))
        object.__setattr__(self, "base_url", self.base_url.rstrip("/"))
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend '{self.backend}'; expected one of: {', '.join(BACKENDS)}")
        check_endpoint(self.backend, self.endpoint)
        if self.dataset.name == "random-mm" and self.backend != "openai-chat":
            raise ValueError(f"--dataset-name random-mm sends images: it needs --backend openai-chat (got {self.backend!r})")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://, got '{self.base_url}'")
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 (or inf), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"--burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.num_warmups < 0:
            raise ValueError(f"--num-warmups must be >= 0, got {self.num_warmups}")

    @property
    def api_url(self) -> str:
        return self.base_url + self.endpoint


class BenchmarkError(RuntimeError):
    """The benchmark could not run at all (server unreachable, initial request failed, ...)."""


def arrival_times(num_requests: int, request_rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Start offsets (s) of each request from the benchmark start; request 0 starts at 0."""
    if math.isinf(request_rate):
        return np.zeros(num_requests)
    rng = np.random.default_rng(seed)
    theta = 1.0 / (request_rate * burstiness)
    gaps = rng.gamma(shape=burstiness, scale=theta, size=num_requests)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


def load_tokenizer(name: str, trust_remote_code: bool = False) -> Any:
    """The tokenizer of `name`, never from a model hub (HF_HUB_OFFLINE's rule: the local cache
    at most): a local directory, `demo` (the built-in model's), `preset:NAME` (the synthetic one
    `atomctl serve` uses), or a hub id already in the Hugging Face cache. ValueError in one line."""
    tokenizer = _local_tokenizer(name, trust_remote_code)
    if tokenizer is None:
        raise ValueError(f"cannot load tokenizer '{name}': {_NO_TOKENIZER}")
    return tokenizer


_NO_TOKENIZER = ("not a local directory, 'demo', preset:NAME or a hub id in the Hugging Face cache (model hubs "
                 "are not used); pass --tokenizer with the model's directory")


def _local_tokenizer(name: str, trust_remote_code: bool) -> Any | None:
    """The tokenizer `load_tokenizer` describes, or None when there is none here."""
    from transformers import AutoTokenizer

    from atom_core.loader.model_dir import DEMO_MODEL, resolve_model_files

    if name == DEMO_MODEL or name.startswith("preset:"):
        return resolve_model_files(name).serving_tokenizer()
    path = Path(name).expanduser()
    directory = path if path.is_dir() else _cached_snapshot(name)
    if directory is None:
        return None
    try:  # a directory: transformers reads its files and asks no hub
        return AutoTokenizer.from_pretrained(str(directory), trust_remote_code=trust_remote_code)
    except (OSError, ValueError):  # no tokenizer files there: the caller says so
        return None


def _cached_snapshot(repo_id: str) -> Path | None:
    """The Hugging Face cache's snapshot directory of `repo_id` holding its tokenizer, read from
    the file system: even with local_files_only, transformers' hub calls contact the hub (for
    their request headers)."""
    from huggingface_hub import try_to_load_from_cache

    for filename in ("tokenizer_config.json", "tokenizer.json"):
        try:
            found = try_to_load_from_cache(repo_id, filename)
        except ValueError:  # not a valid repo id (HFValidationError)
            return None
        if isinstance(found, str):
            return Path(found).parent
    return None


@dataclass(frozen=True)
class ServedModel:
    """A model as the server's /v1/models lists it; root and max_model_len where it says them
    (vLLM and atomctl serve do: root is the checkpoint the server loaded)."""

    id: str
    root: str | None = None
    max_model_len: int | None = None


def check_server(base_url: str, timeout_s: float = 10.0) -> None:
    """Fail fast (before loading a tokenizer) when nothing answers at base_url; any HTTP status will do."""
    try:
        httpx.get(base_url + "/", headers=auth_headers(), timeout=timeout_s)
    except httpx.TransportError as err:
        raise BenchmarkError(f"cannot reach the server at {base_url}: {type(err).__name__}: {err}") from err


def fetch_served_model(base_url: str, model: str | None = None, timeout_s: float = 10.0) -> ServedModel:
    """The /v1/models entry named `model` (the first one when None). With `model` given, a server
    that does not list it (or has no /v1/models) gives ServedModel(model): nothing more is known."""
    try:
        response = httpx.get(base_url + "/v1/models", headers=auth_headers(), timeout=timeout_s)
        response.raise_for_status()
        entries = [e for e in response.json()["data"] if model is None or e.get("id") == model]
        entry = entries[0]
    except (httpx.HTTPError, KeyError, IndexError, ValueError, TypeError) as err:
        if model is not None:
            return ServedModel(model)
        raise BenchmarkError(f"--model not given and {base_url}/v1/models did not name one: {err}") from err
    max_len = entry.get("max_model_len")
    return ServedModel(entry["id"], entry.get("root"), max_len if isinstance(max_len, int) else None)


@dataclass(frozen=True)
class PreparedRun:
    """What a run needs before its first request: the served model and its tokenizer."""

    model_id: str
    tokenizer_id: str
    tokenizer: Any
    max_model_len: int | None  # the server's, where /v1/models says it


def prepare_run(cfg: ServeBenchConfig, tokenizer: Any = None) -> PreparedRun:
    """Ask the server for its model and find the tokenizer: --tokenizer, else the server's root,
    else the model name; never from a hub."""
    check_server(cfg.base_url)
    served = fetch_served_model(cfg.base_url, cfg.model)
    if cfg.tokenizer is not None:
        candidates = [cfg.tokenizer]
    else:
        candidates = list(dict.fromkeys(n for n in (served.root, served.id) if n))
    tokenizer_id = candidates[0]
    if tokenizer is None:
        for name in candidates:
            tokenizer = _local_tokenizer(name, cfg.trust_remote_code)
            if tokenizer is not None:
                tokenizer_id = name
                break
        else:
            tried = " or ".join(f"'{n}'" for n in candidates)
            raise ValueError(f"cannot find the tokenizer of model '{served.id}': {tried} is {_NO_TOKENIZER}")
    return PreparedRun(served.id, tokenizer_id, tokenizer, served.max_model_len)


def sample_fitting_requests(run: PreparedRun, cfg: ServeBenchConfig, console: Console) -> list[SampleRequest]:
    """cfg's prompts, their default lengths fitted to the server's max_model_len (with a notice on
    `console`); ValueError naming the dataset's length flags when a request cannot fit."""
    dataset = cfg.dataset
    if run.max_model_len is not None:
        dataset, notice = fit_to_model(dataset, run.max_model_len)
        if notice:
            console.print(notice, style="yellow", highlight=False)
    requests = sample_requests(dataset, run.tokenizer, cfg.num_prompts, cfg.seed)
    if run.max_model_len is not None:
        check_fit(dataset, requests, run.max_model_len)
    return requests


def run_benchmark(
    cfg: ServeBenchConfig,
    *,
    tokenizer: Any = None,
    requests: Sequence[SampleRequest] | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Run one benchmark and return vLLM's result dict (date, backend, model_id, ... e2el keys).

    `tokenizer` and `requests` default to loading `cfg.tokenizer or model` and sampling
    `cfg.dataset`; pass them to reuse across runs (as sweeps do).
    """
    console = console or Console()
    run = prepare_run(cfg, tokenizer)
    model_id, tokenizer_id, tokenizer = run.model_id, run.tokenizer_id, run.tokenizer
    if requests is None:
        requests = sample_fitting_requests(run, cfg, console)
    result = asyncio.run(benchmark(cfg, model_id, list(requests), tokenizer, console))
    header = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": cfg.backend,
        "model_id": model_id,
        "tokenizer_id": tokenizer_id,
        "num_prompts": len(requests),
        **cfg.metadata,
        "request_rate": cfg.request_rate if math.isfinite(cfg.request_rate) else "inf",
        "burstiness": cfg.burstiness,
        "max_concurrency": cfg.max_concurrency,
    }
    return {**header, **result}


async def benchmark(
    cfg: ServeBenchConfig,
    model_id: str,
    requests: list[SampleRequest],
    tokenizer: Any,
    console: Console,
) -> dict[str, Any]:
    """The run: initial test request, warm-ups, optional profiling, timed run, metrics."""
    request_func = REQUEST_FUNCS[cfg.backend]
    inputs = [
        RequestInput(
            prompt=r.prompt, api_url=cfg.api_url, prompt_len=r.prompt_len, output_len=r.expected_output_len,
            model=cfg.lora_modules[i % len(cfg.lora_modules)] if cfg.lora_modules else cfg.served_model_name or model_id,
            ignore_eos=cfg.ignore_eos, extra_body=cfg.extra_body, images=r.images,
        )
        for i, r in enumerate(requests)
    ]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=cfg.max_concurrency or 256)
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        if cfg.initial_test:
            console.print("Starting initial single prompt test run...")
            test = await request_func(client, replace(inputs[0], output_len=min(inputs[0].output_len, 16)))
            if not test.success:
                raise BenchmarkError(f"initial test request to {cfg.api_url} failed: {_first_line(test.error)}")
        if cfg.num_warmups:
            console.print(f"Warming up with {cfg.num_warmups} requests...")
            await _run_requests(client, request_func, [inputs[0]] * cfg.num_warmups, np.zeros(cfg.num_warmups),
                                cfg.max_concurrency, None)
        if cfg.profile:
            await _profile_call(client, cfg.base_url, "start_profile")
            console.print("Profiler started")
        console.print(
            f"Traffic request rate: {cfg.request_rate}, burstiness: {cfg.burstiness}, "
            f"max concurrency: {cfg.max_concurrency}"
        )
        arrivals = arrival_times(len(inputs), cfg.request_rate, cfg.burstiness, cfg.seed)
        with progress_bar(console, "benchmark", len(inputs), cfg.show_progress) as advance:
            start = time.perf_counter()
            outputs = await _run_requests(client, request_func, inputs, arrivals, cfg.max_concurrency, advance)
            duration = time.perf_counter() - start
        if cfg.profile:
            try:  # the measurements stand even if the profiler fails to stop
                await _profile_call(client, cfg.base_url, "stop_profile")
                console.print("Profiler stopped")
            except BenchmarkError as err:
                console.print(f"[bold red]WARNING: {err}[/]", highlight=False)
    return build_result(requests, outputs, duration, tokenizer, cfg)


async def _run_requests(client, request_func, inputs, arrivals, max_concurrency, advance) -> list[RequestOutput]:
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    loop_start = time.perf_counter()

    async def one(inp: RequestInput) -> RequestOutput:
        if semaphore is None:
            output = await request_func(client, inp)
        else:
            async with semaphore:
                output = await request_func(client, inp)
        if advance is not None:
            advance()
        return output

    tasks = []
    for inp, offset in zip(inputs, arrivals):
        delay = loop_start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(inp)))
    return list(await asyncio.gather(*tasks))


async def _profile_call(client: httpx.AsyncClient, base_url: str, verb: str) -> None:
    url = f"{base_url}/{verb}"
    try:
        response = await client.post(url, headers=auth_headers())
    except httpx.HTTPError as err:
        raise BenchmarkError(f"--profile: POST {url} failed: {type(err).__name__}: {err}") from err
    if response.status_code != 200:
        raise BenchmarkError(f"--profile: POST {url} returned HTTP {response.status_code}: {response.text[:200]}")


def build_result(
    requests: Sequence[SampleRequest],
    outputs: Sequence[RequestOutput],
    duration_s: float,
    tokenizer: Any,
    cfg: ServeBenchConfig,
) -> dict[str, Any]:
    """vLLM's benchmark() return value: duration, aggregates, per-request lists, latency keys."""
    metrics, output_lens = calculate_metrics(
        requests, outputs, duration_s, tokenizer, cfg.metric_percentiles, cfg.goodput
    )
    details = {
        "input_lens": [r.prompt_len for r in requests],
        "output_lens": output_lens,
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
    }
    return {
        "duration": duration_s,
        **throughput_result(metrics, bool(cfg.goodput)),
        **details,
        **latency_result(metrics, cfg.percentile_metrics),
    }


def report(result: dict[str, Any], console: Console) -> None:
    """Print the results table; failures are shown loudly with their distinct errors."""
    console.print(result_table(result))
    errors = [e for e in result.get("errors", []) if e]
    if not errors:
        return
    console.print(
        f"[bold red]WARNING: {len(errors)} of {result['num_prompts']} requests FAILED; "
        "the metrics above cover successful requests only.[/]"
    )
    counts: dict[str, int] = {}
    for error in errors:
        counts[_first_line(error)] = counts.get(_first_line(error), 0) + 1
    for message, count in sorted(counts.items(), key=lambda kv: -kv[1])[:10]:
        console.print(f"[red]  {count} x {message}[/]", markup=True, highlight=False)


def default_result_filename(result: dict[str, Any]) -> str:
    """vLLM's name: {backend}-{rate}qps[-concurrency{N}]-{model}-{date}.json."""
    rate = result["request_rate"]
    rate_str = "inf" if rate == "inf" else str(float(rate))
    concurrency = result.get("max_concurrency")
    concurrency_str = f"-concurrency{concurrency}" if concurrency is not None else ""
    model = str(result["model_id"]).rstrip("/").split("/")[-1]
    return f"{result['backend']}-{rate_str}qps{concurrency_str}-{model}-{result['date']}.json"


def save_result(
    result: dict[str, Any], result_dir: str | Path | None = None, result_filename: str | None = None
) -> Path:
    path = Path(result_dir or ".") / (result_filename or default_result_filename(result))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    return path


def _first_line(text: str) -> str:
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[0][:300] if lines else "(no error message)"
