"""`atomctl eval`: lm-eval tasks against an atom_core server (started here, or given by --base-url)."""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from atomctl.errors import DEBUG, friendly_errors


def parse_limit(limit: Optional[float]) -> int | float | None:
    """lm-eval's convention: a whole number is a document count, a value below 1 a fraction."""
    if limit is None or limit < 1:
        return limit
    if limit != int(limit):
        raise ValueError(f"invalid --limit {limit}; expected a whole count >= 1 or a fraction below 1")
    return int(limit)


# The built-in tasks write the demo model's chat format out as text; with --apply-chat-template
# the template would wrap it a second time, so they switch to their chat form (the bare question).
CHAT_FORMS = {"atom_arith_gen": "atom_arith_gen_chat", "atom_arith": "atom_arith_gen_chat"}
LOGLIKELIHOOD_ONLY = ("atom_arith_mc",)


def tasks_for_chat(tasks: tuple[str, ...]) -> tuple[str, ...]:
    """The task list to run with --apply-chat-template (built-in tasks in their chat form)."""
    bad = [t for t in tasks if t in LOGLIKELIHOOD_ONLY]
    if bad:
        raise ValueError(f"{', '.join(bad)} scores log-likelihoods, which the chat API does not return; "
                         "run it without --apply-chat-template")
    return tuple(dict.fromkeys(CHAT_FORMS.get(t, t) for t in tasks))


@friendly_errors
def eval_cmd(
    tasks: str = typer.Option("atom_arith", "--tasks", "-t",
                              help="Comma-separated lm-eval tasks, groups or tags. Built in (offline): "
                                   "atom_arith_gen, atom_arith_mc, or both as atom_arith."),
    model: Optional[str] = typer.Option(None, "--model", "-m",
                                        help="Model directory, preset:NAME or 'demo' to serve for the run "
                                             "(default: demo). With --base-url it only names the tokenizer."),
    base_url: Optional[str] = typer.Option(None, "--base-url",
                                           help="A running OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1."),
    tokenizer: Optional[str] = typer.Option(None, help="Tokenizer directory (default: the model's)."),
    num_fewshot: Optional[int] = typer.Option(None, "--num-fewshot", help="Few-shot examples (default: the task's)."),
    limit: Optional[float] = typer.Option(None, "--limit",
                                          help="Documents per task; below 1, a fraction of each task."),
    num_concurrent: int = typer.Option(8, "--num-concurrent", help="Requests in flight at once."),
    output_path: Optional[Path] = typer.Option(None, "--output-path",
                                               help="Write results.json and per-sample logs to this directory."),
    apply_chat_template: bool = typer.Option(False, "--apply-chat-template",
                                             help="Send chat messages to /v1/chat/completions "
                                                  "(local-chat-completions; generation tasks only). "
                                                  "Built-in tasks run in their chat form: atom_arith and "
                                                  "atom_arith_gen become atom_arith_gen_chat."),
    backend: str = typer.Option("server", help="server (atom_core over HTTP) or hf (lm-eval's transformers "
                                               "backend on --model, the reference)."),
    serve_args: Optional[str] = typer.Option(None, "--serve-args",
                                             help="Extra `atomctl serve` options for the started server, "
                                                  "e.g. '--device cpu --enforce-eager'."),
    device: str = typer.Option("cpu", help="hf backend only: torch device."),
    dtype: str = typer.Option("auto", help="hf backend only: auto (the model's), bfloat16 or float32."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks and lm-eval's logs."),
):
    """Score a model with lm-eval (needs the eval extra) and print the results table."""
    import logging

    from atom_core.eval import EvalConfig, run_eval
    from atomctl.engine_options import resolve_model_arg

    if debug:
        DEBUG["enabled"] = True
        logging.getLogger().setLevel(logging.INFO)
    if model is None and base_url is None:
        model = "demo"
    task_names = tuple(t.strip() for t in tasks.split(","))
    config = EvalConfig(
        tasks=tasks_for_chat(task_names) if apply_chat_template else task_names,
        model=resolve_model_arg(model) if model else None,
        base_url=base_url,
        tokenizer=tokenizer,
        backend=backend,
        num_fewshot=num_fewshot,
        limit=parse_limit(limit),
        num_concurrent=num_concurrent,
        output_path=output_path,
        apply_chat_template=apply_chat_template,
        serve_args=tuple(shlex.split(serve_args or "")),
        hf_device=device,
        hf_dtype=dtype,
    )
    result = run_eval(config)
    console = Console()
    console.print(results_table(result.rows, title=f"lm-eval: {backend}"))
    for path in result.written:
        console.print(f"wrote {path}")


def results_table(rows, title: str) -> Table:
    """Numbers are never cut: their columns keep their widest cell, and where the terminal is narrow
    the task and metric names wrap instead (at spaces, else folded; never cut off)."""
    cells = []
    for row in rows:
        metric = row.metric if row.filter == "none" else f"{row.metric} ({row.filter})"
        stderr = f"{row.stderr:.4f}" if row.stderr is not None else "n/a"
        cells.append((row.task, metric, str(row.num_fewshot), str(row.num_samples), f"{row.value:.4f}", stderr))
    table = Table(title=title)
    table.add_column("task", overflow="fold")
    table.add_column("metric (filter)", overflow="fold")
    for i, column in enumerate(("shots", "docs", "value", "stderr"), start=2):
        width = max([len(column), *(len(c[i]) for c in cells)])
        table.add_column(column, justify="right", no_wrap=True, min_width=width)
    for row_cells in cells:
        table.add_row(*row_cells)
    return table


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_cmd)
