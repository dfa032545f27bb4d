"""`atomctl bench soak`: many streams against a running server, some clients hanging up mid-stream; checks
that every other request finished whole, that no KV block stays held once the server is idle, and that
the engine's memory stayed flat (atom_core/bench/soak.py)."""
import json
from pathlib import Path
from typing import Optional

import typer

from atomctl.errors import friendly_errors

SOAK_FAILED_EXIT = 3  # the soak ran and a check failed (bad input or no server: 1, as every command)


@friendly_errors
def soak_cmd(
    base_url: str = typer.Option("http://127.0.0.1:8000", help="The server (atomctl serve) to soak."),
    model: Optional[str] = typer.Option(None, help="Served model name (default: the first of /v1/models)."),
    num_prompts: int = typer.Option(2000, help="Requests in the soak (after a warm-up round of --max-concurrency)."),
    max_concurrency: int = typer.Option(512, help="Concurrent streams (closed loop: each sends its next at once)."),
    disconnect_fraction: float = typer.Option(0.2, help="Fraction of requests whose client hangs up mid-stream."),
    input_len: int = typer.Option(256, help="Prompt tokens per request (random ids below --vocab-size)."),
    output_len: int = typer.Option(128, help="Output tokens per request (ignore_eos)."),
    vocab_size: int = typer.Option(32000, help="Prompt ids are drawn below this; at most the model's vocabulary."),
    seed: int = typer.Option(0, help="Seeds the prompts and which clients hang up, and when."),
    settle_timeout: float = typer.Option(60.0, help="Seconds to wait for the server to go idle after the soak."),
    max_memory_growth_mb: float = typer.Option(64.0, help="Allowed growth of the engine's memory "
                                               "(atom_engine_memory_bytes) from after the warm-up to the end."),
    output_json: Optional[Path] = typer.Option(None, help="Write the result as JSON."),
):
    """Soak a server: streams with clients that disconnect, then leak and memory checks.

    Exit status 0 when every check holds, 3 when one failed (each is printed), 1 on bad input.
    """
    from rich.console import Console
    from rich.table import Table

    from atom_core.bench.soak import SoakConfig, run_soak

    cfg = SoakConfig(base_url=base_url.rstrip("/"), num_prompts=num_prompts, concurrency=max_concurrency,
                     disconnect_fraction=disconnect_fraction, input_len=input_len, output_len=output_len,
                     vocab_size=vocab_size, seed=seed, model=model, settle_timeout_s=settle_timeout,
                     max_memory_growth_mb=max_memory_growth_mb)
    console = Console()
    result = run_soak(cfg)
    table = Table("soak", "value")
    for name, value in (("requests / concurrency", f"{result.num_prompts} / {result.concurrency}"),
                        ("completed whole", result.completed), ("failed", result.failed),
                        ("disconnected by the client", result.disconnected),
                        ("aborted by the server (hung up before the end)", result.server_aborts),
                        ("seconds", result.duration_s),
                        ("KV blocks held when idle", f"{result.kv_blocks_leaked} of {result.kv_blocks_total}"),
                        ("engine memory after warm-up / at the end (MB)",
                         f"{result.memory_baseline_mb} / {result.memory_final_mb}")):
        table.add_row(name, str(value))
    console.print(table)
    if output_json is not None:
        output_json.parent.mkdir(parents=True, exist_ok=True)
        output_json.write_text(json.dumps(result.as_dict(), indent=2))
        console.print(f"saved {output_json}")
    for problem in result.problems:
        console.print(f"FAILED: {problem}")
    if not result.passed:
        raise typer.Exit(SOAK_FAILED_EXIT)
    console.print("passed")


def register(bench_app: typer.Typer) -> None:
    bench_app.command("soak")(soak_cmd)
