"""Output of parse-trace: xlsx workbooks, rich tables on the terminal, PNG bar charts."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
from rich.console import Console
from rich.table import Table

from atom_core.profiling.breakdown import PhaseBreakdown, TraceBreakdown


def write_workbooks(breakdown: TraceBreakdown, out_dir: str | Path) -> list[Path]:
    """`{phase}_breakdown.xlsx` per phase found; the sheets are listed in breakdown.py."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for phase, pb in breakdown.phases.items():
        path = out_dir / f"{phase}_breakdown.xlsx"
        with pd.ExcelWriter(path, engine="openpyxl") as writer:
            for sheet, table in pb.sheets.items():
                table.to_excel(writer, sheet_name=sheet, index=False)
        paths.append(path)
    return paths


def write_plots(breakdown: TraceBreakdown, out_dir: str | Path, top: int = 25) -> list[Path]:
    """`{phase}_breakdown.png`: per-module time of the average layer (or per module type when
    the trace has no layer ranges), largest first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for phase, pb in breakdown.phases.items():
        labels, values, what = _plot_series(pb, top)
        fig, ax = plt.subplots(figsize=(10, 0.35 * len(labels) + 1.5))
        ax.barh(labels[::-1], values[::-1])
        ax.set_xlabel("time (us)")
        ax.set_title(f"{phase}: {what} ({pb.num_steps_averaged} of {pb.num_steps} steps averaged)")
        fig.tight_layout()
        path = out_dir / f"{phase}_breakdown.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def _plot_series(pb: PhaseBreakdown, top: int) -> tuple[list[str], list[float], str]:
    table = pb.all_layers_table
    if len(table):
        per_module = table.groupby("cpu_module", sort=False)["duration_us"].sum().sort_values(ascending=False)
        per_module = per_module.head(top)
        return list(per_module.index), list(per_module.values), "time per module, average layer"
    summary = pb.summary[pb.summary["module_type"] != "total"]
    return list(summary["module_type"]), list(summary["duration_us"]), "time per module type"


def print_breakdown(breakdown: TraceBreakdown, console: Console | None = None, top: int = 20) -> None:
    """The first `top` rows of each phase's layer sheet, and its summary. A trace without layer
    ranges (graph replays not run with --mark-trace) gets the step's `top` kernels by total time
    instead, so the terminal shows them even where no xlsx can be written."""
    console = console or Console()
    for phase, pb in breakdown.phases.items():
        table = pb.layer_table
        steps = f"({pb.num_steps_averaged} of {pb.num_steps} steps averaged)"
        if table.empty:
            kernels = kernels_by_name(pb.sheets["full_step"])
            title = f"{phase}: whole step, top {min(top, len(kernels))} of {len(kernels)} kernel names {steps}"
            console.print(_rich_table(title, kernels.head(top), console.width))
        else:
            title = f"{phase}: layer {pb.layer}, first {min(top, len(table))} of {len(table)} kernels {steps}"
            console.print(_rich_table(title, table.head(top), console.width))
        console.print(_rich_table(f"{phase}: whole step per module type", pb.summary, console.width))
    for note in breakdown.notes:
        console.print(f"[yellow]note:[/yellow] {note}")


def kernels_by_name(full_step: pd.DataFrame) -> pd.DataFrame:
    """A step's kernels summed by name, largest total first: gpu_kernel, duration_us, launches."""
    grouped = full_step.groupby("gpu_kernel", sort=False)["duration_us"].agg(["sum", "count"]).reset_index()
    grouped.columns = ["gpu_kernel", "duration_us", "launches"]
    return grouped.sort_values("duration_us", ascending=False, kind="stable").reset_index(drop=True)


_KERNEL_MIN_WIDTH = 8  # the kernel-name column folds into what is left, but not narrower than this


def _rich_table(title: str, frame: pd.DataFrame, width: int = 80) -> Table:
    """Numbers and module names keep their width on one line (a narrow terminal neither cuts a
    number nor breaks `layers.3.self_attn.qkv_proj` mid-word): only a module name wider than what a
    `width`-column terminal leaves ends in an ellipsis. The kernel names, which run long, fold in
    the width left over."""
    rows = [[_cell(v) for v in row] for row in frame.itertuples(index=False)]
    widest = [max([len(str(c)), *(len(row[i]) for row in rows)]) for i, c in enumerate(frame.columns)]
    numeric = [pd.api.types.is_numeric_dtype(frame[c]) for c in frame.columns]
    kernels = [c == "gpu_kernel" for c in frame.columns]
    names = [not (n or k) for n, k in zip(numeric, kernels)]
    # Each column costs its cell plus 3 (padding and a border); the table one more border.
    fixed = sum(w for w, n in zip(widest, numeric) if n) + 3 * len(widest) + 1 + _KERNEL_MIN_WIDTH * sum(kernels)
    name_room = max(8, (width - fixed) // max(1, sum(names)))
    table = Table(title=title, title_justify="left")
    for column, w, is_number, is_kernel in zip(frame.columns, widest, numeric, kernels):
        if is_kernel:
            table.add_column(str(column), overflow="fold", min_width=min(w, _KERNEL_MIN_WIDTH))
        elif is_number:
            table.add_column(str(column), justify="right", no_wrap=True, min_width=w)
        else:
            table.add_column(str(column), no_wrap=True, overflow="ellipsis", min_width=min(w, name_room))
    for row in rows:
        table.add_row(*row)
    return table


def _cell(value: object) -> str:
    if isinstance(value, float):
        return "" if pd.isna(value) else f"{value:,.1f}"
    text = str(value)
    return text if len(text) <= 90 else text[:87] + "..."  # C++ kernel names run to kilobytes
