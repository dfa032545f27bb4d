"""One-line errors for users; tracebacks only with --debug."""
from __future__ import annotations

import functools
import sys

import typer

DEBUG = {"enabled": False}


def friendly_errors(fn):
    """Turn ValueError/FileNotFoundError/... into `error: message` and exit code 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, KeyboardInterrupt):
            raise
        except Exception as e:  # noqa: BLE001 - the CLI boundary: every failure becomes one line
            if DEBUG["enabled"]:
                raise
            print(f"error: {e}", file=sys.stderr)
            raise typer.Exit(1) from None

    return wrapper
