"""`atomctl serve`: the OpenAI-compatible HTTP server (engine core in its own process)."""
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from atomctl.engine_options import engine_kwargs, with_engine_options
from atomctl.errors import friendly_errors


@friendly_errors
@with_engine_options
def serve_cmd(
    ctx: typer.Context,
    model_tag: Optional[str] = typer.Argument(
        None, metavar="MODEL", help="The model, as vLLM takes it (`atomctl serve DIR`); the same as --model."),
    host: str = typer.Option("127.0.0.1", help="Address to bind; pass 0.0.0.0 to listen on every interface."),
    port: int = typer.Option(8000, help="TCP port."),
    api_key: Optional[str] = typer.Option(
        None, help="Require 'Authorization: Bearer KEY' on /v1 and profiling endpoints (default: ATOM_API_KEY)."
    ),
    served_model_name: Optional[str] = typer.Option(None, help="The model name clients send (default: the --model value)."),
    access_log: bool = typer.Option(False, "--access-log/--no-access-log", help="Log every HTTP request."),
    tool_call_parser: Optional[str] = typer.Option(
        None, help="Parse tool calls from the model's text: hermes, llama3_json, deepseek_v3, deepseek_v31, openai."),
    enable_auto_tool_choice: bool = typer.Option(
        False, "--enable-auto-tool-choice", help="Let the model decide when to call tools (tool_choice auto); needs --tool-call-parser."),
    reasoning_parser: Optional[str] = typer.Option(
        None, help="Split reasoning into reasoning_content: qwen3, deepseek_r1, gpt_oss."),
    shutdown_timeout: float = typer.Option(
        30.0, help="Seconds SIGTERM waits for requests in flight; then they end with an error and the server exits 0."),
    max_request_bytes: int = typer.Option(8 * 1024 * 1024, help="Larger request bodies get 413, unparsed."),
    body_read_timeout: float = typer.Option(30.0, help="Seconds to receive a request body, else 408."),
    metrics_prefix: str = typer.Option("atom", help="Metric names: atom (atom_*) or vllm (vllm:*, for vLLM dashboards)."),
    allowed_local_media_path: Optional[Path] = typer.Option(
        None, help="Serve image_url file:// URLs (and absolute paths) of files under this directory; off by default."),
    limit_mm_per_prompt: Optional[str] = typer.Option(
        None, help='Most images one request may carry, as vLLM writes it: {"image": 4} (default 16).'),
    media_fetch_timeout: float = typer.Option(10.0, help="Seconds to fetch one http(s) image_url, else 400."),
    max_media_bytes: int = typer.Option(20 * 1024 * 1024, help="Largest encoded image (any source), else 400."),
    allowed_media_domains: Optional[list[str]] = typer.Option(
        None, help="Fetch http(s) image_url only from this host (repeat the flag for more; redirects included); "
                   "default any host."),
    engine_args: dict = None,
):
    """Serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models) plus /health and /metrics."""
    from atom_core.config import serving_config
    from atom_core.envs import read_envs
    from atom_core.server.app import ServerOptions, run_server
    from atom_core.server.chat_output import ChatOptions
    from atom_core.server.media import MediaOptions, parse_limit_mm_per_prompt

    engine_args = {**engine_args, "model": _model_choice(ctx, model_tag, engine_args["model"])}
    media = MediaOptions(allowed_local_media_path, parse_limit_mm_per_prompt(limit_mm_per_prompt), media_fetch_timeout,
                         max_media_bytes, tuple(allowed_media_domains) if allowed_media_domains else None)
    options = ServerOptions(shutdown_timeout, max_request_bytes, body_read_timeout, metrics_prefix, media)
    chat_options = ChatOptions(tool_call_parser, enable_auto_tool_choice, reasoning_parser)  # bad names fail here, before the engine starts
    kwargs = engine_kwargs(engine_args)
    # Streaming clients want every token as it comes: windows would deliver them in bursts of
    # num_scheduler_steps tokens, multiplying the inter-token latency for no throughput gain.
    kwargs.setdefault("num_scheduler_steps", 1)
    # A loaded server mixes prompt chunks into most decode steps: they replay piecewise graphs.
    config = serving_config(**kwargs)
    if reasoning_parser is None:  # e.g. GPT-OSS: Harmony's analysis channel is reasoning_content
        chat_options = ChatOptions(tool_call_parser, enable_auto_tool_choice, _implied_reasoning_parser(config))
    if config.parallel.node_rank > 0:  # a node other than 0 runs only its tensor-parallel ranks
        from atom_core.worker.multiproc_executor import run_node_workers

        raise typer.Exit(run_node_workers(config))
    api_key = api_key or read_envs().api_key  # the flag wins over the environment
    status = run_server(config, host, port, served_model_name or engine_args["model"], api_key=api_key,
                        access_log=access_log, chat_options=chat_options, options=options)
    if status:  # the engine core died: exit non-zero at once (everything is shut down), so a supervisor restarts us
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)  # skips interpreter teardown (seconds with torch loaded), which the 5 s promise cannot afford


def _model_choice(ctx: typer.Context, positional: Optional[str], flag: str) -> str:
    """vLLM's `serve MODEL` or --model; both may be given only when they agree."""
    if positional is None:
        return flag
    source = ctx.get_parameter_source("model")  # typer's own click: compare the source by name
    flag_given = source is not None and source.name != "DEFAULT"
    if flag_given and flag != positional:
        raise ValueError(f"the model is given twice, as MODEL {positional!r} and --model {flag!r}; give one of them")
    return positional


def _implied_reasoning_parser(config) -> Optional[str]:
    from atom_core.loader import resolve_model_files
    from atom_core.server.reasoning import default_reasoning_parser

    try:
        hf_config = resolve_model_files(config.model.model, config.model.tokenizer).hf_config
    except (OSError, ValueError):  # no readable checkpoint: the engine's start reports that, with its own message
        return None
    model_type = getattr(hf_config, "model_type", None)
    name = default_reasoning_parser(model_type)
    if name:
        typer.echo(f"reasoning parser: {name} (implied by model_type {model_type!r}; --reasoning-parser overrides)",
                   err=True)
    return name


def register(app: typer.Typer) -> None:
    app.command("serve")(serve_cmd)
