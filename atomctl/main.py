"""`atomctl`: serve, generate, bench, profile, parse-trace, eval."""
import logging

import typer
from typer.core import TyperGroup

from atomctl.engine_options import expand_lora_modules
from atomctl.errors import DEBUG


class _Commands(TyperGroup):
    """atomctl's commands, with vLLM's multi-value --lora-modules rewritten into repeated flags first."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        return super().parse_args(ctx, expand_lora_modules(args))


# Plain click help (rich_markup_mode=None): rich's tables cut long option names at 80 columns.
app = typer.Typer(help="atomctl: a small, fast LLM inference engine and its tools.", no_args_is_help=True,
                  pretty_exceptions_enable=False, rich_markup_mode=None, cls=_Commands)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _log_level(value: str) -> str:
    if value.upper() not in LOG_LEVELS:
        raise typer.BadParameter(f"unknown log level {value!r}; expected one of: {', '.join(LOG_LEVELS)}")
    return value.upper()


@app.callback()
def main(debug: bool = typer.Option(False, "--debug", help="Show tracebacks and debug logs."),
         log_level: str = typer.Option("WARNING", callback=_log_level,
                                       help=f"Python log level for atom_core: {', '.join(LOG_LEVELS)} (any case).")):
    DEBUG["enabled"] = debug
    logging.basicConfig(level=logging.DEBUG if debug else getattr(logging, log_level),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _register() -> None:
    from atomctl import generate

    generate.register(app)

    from atomctl import profile

    profile.register(app)

    from atomctl import bench, bench_api_overhead, bench_offline, bench_soak

    bench_offline.register(bench.bench_app)
    bench_api_overhead.register(bench.bench_app)
    bench_soak.register(bench.bench_app)
    app.add_typer(bench.bench_app, name="bench")
    from atomctl import serve

    serve.register(app)

    from atomctl import eval_cmd

    eval_cmd.register(app)


_register()


if __name__ == "__main__":
    app()
