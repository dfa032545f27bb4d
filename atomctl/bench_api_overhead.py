"""`atomctl bench api-overhead`: the API process's cost per streamed token (no model, no GPU)."""
import json
from pathlib import Path
from typing import Optional

import typer

from atomctl.errors import friendly_errors


def parse_concurrencies(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"bad --concurrency '{text}'; expected integers like 64,256") from None
    if not values:
        raise ValueError(f"bad --concurrency '{text}'; expected integers like 64,256")
    return values


@friendly_errors
def api_overhead_cmd(
    model: str = typer.Option("preset:Llama-3-8B", help="Model directory or preset:NAME; only its config and "
                              "tokenizer are used (a preset gets the synthetic tokenizer, as `atomctl serve`)."),
    concurrency: str = typer.Option("64,256", help="Comma list of concurrent streams, one run each."),
    step_ms: float = typer.Option(15.0, help="Simulated device time of one engine step (0: as fast as the host)."),
    input_len: int = typer.Option(1024, help="Prompt tokens per request."),
    output_len: int = typer.Option(128, help="Output tokens per request (ignore_eos)."),
    requests_per_stream: int = typer.Option(2, help="Requests per stream: num_prompts = concurrency x this."),
    max_num_batched_tokens: int = typer.Option(8192, help="The stand-in core's per-step token budget."),
    log_dir: Path = typer.Option(Path("bench_results"), help="Where the server's log goes."),
    output_json: Optional[Path] = typer.Option(None, help="Write the result as JSON."),
):
    """Per-token cost of the API process: real server and core messages, a stand-in model step.

    Reports sample-to-SSE-write latency, API/core/client CPU per token, tokens/s and steps/s.
    """
    from rich.console import Console

    from atom_core.bench.api_overhead import ApiOverheadConfig, result_table, run_api_overhead

    cfg = ApiOverheadConfig(model=model, concurrencies=parse_concurrencies(concurrency), step_ms=step_ms,
                            input_len=input_len, output_len=output_len, requests_per_stream=requests_per_stream,
                            max_num_batched_tokens=max_num_batched_tokens)
    console = Console()
    result = run_api_overhead(cfg, log_dir, console)
    console.print(result_table(result))
    if output_json is not None:
        output_json.parent.mkdir(parents=True, exist_ok=True)
        output_json.write_text(json.dumps(result, indent=2))
        console.print(f"saved {output_json}")


def register(bench_app: typer.Typer) -> None:
    bench_app.command("api-overhead")(api_overhead_cmd)
