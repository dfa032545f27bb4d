"""The benchmarks' rich progress bar: one task, a count of done over total, the time elapsed."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


@contextlib.contextmanager
def progress_bar(console: Console, label: str, total: int, enabled: bool = True) -> Iterator[Callable[..., None]]:
    """A bar labelled `label` (or nothing when not `enabled`); yields `advance(n=1)`."""
    bar = Progress(
        TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, disable=not enabled,
    )
    task = bar.add_task(label, total=total)
    with bar:
        yield lambda n=1: bar.advance(task, n)
