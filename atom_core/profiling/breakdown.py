"""Per-phase kernel breakdowns of an atom_core trace: the tables behind `atomctl parse-trace`.

Which step a breakdown describes: the steps of a phase are grouped by their kernel sequence
(module and kernel name of every kernel, in order); the most frequent sequence wins (ties: the
earliest), and each row's duration is the mean over the steps of that group. Decode steps of
one batch size share a sequence, so a decode breakdown is the mean of all its decode steps.

Sheets of `{phase}_breakdown.xlsx` (columns in BREAKDOWN_COLUMNS unless said otherwise):

- `layer_{N}`: the kernels of layer N (modules under `layers.N.`), in execution order.
- `all_layers_avg`: the mean layer, module names with the index replaced by `*`: the k-th
  occurrence of a (module, kernel) pair in a layer, summed over the layers and divided by
  their number (a layer without that kernel counts 0, e.g. layer 0's unfused norm), so the
  rows add up to the mean time of one layer. Rows keep the order they first appear in.
- `full_step`: every kernel of the step, layers or not.
- `summary`: module_type, duration_us, percent, num_kernels: the whole step per module type
  (module_types.py has the rules), then a `total` row.
- `steps`: every step of the phase (step, name, wall_us, kernel_us, num_kernels, averaged).

`sum per module` holds the sum of a run of consecutive rows of one module, on its first row.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from atom_core.profiling.conventions import PHASES, Phase, layer_index, normalize_layer
from atom_core.profiling.module_types import MODULE_TYPES, module_type
from atom_core.profiling.trace_events import load_trace
from atom_core.profiling.trace_parser import (
    Attribution,
    KernelRecord,
    attribute_kernels,
    find_capture_traces,
    graph_captures,
    load_graph_captures,
)

BREAKDOWN_COLUMNS = ["cpu_module", "gpu_kernel", "duration_us", "sum per module"]
SUMMARY_COLUMNS = ["module_type", "duration_us", "percent", "num_kernels"]
STEPS_COLUMNS = ["step", "name", "wall_us", "kernel_us", "num_kernels", "averaged"]


@dataclass
class PhaseBreakdown:
    phase: Phase
    layer: int
    sheets: dict[str, pd.DataFrame]  # sheet name -> table, in workbook order
    num_steps: int
    num_steps_averaged: int

    @property
    def layer_table(self) -> pd.DataFrame:
        return self.sheets[f"layer_{self.layer}"]

    @property
    def all_layers_table(self) -> pd.DataFrame:
        return self.sheets["all_layers_avg"]

    @property
    def summary(self) -> pd.DataFrame:
        return self.sheets["summary"]


@dataclass
class TraceBreakdown:
    trace_path: str
    layer: int
    phases: dict[Phase, PhaseBreakdown]
    uses_cpu_rule: bool
    capture_sources: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def parse_trace(
    trace_path: str | Path,
    layer: int = 3,
    capture_paths: list[str | Path] | None = None,
    find_captures: bool = True,
) -> TraceBreakdown:
    """Breakdowns of the prefill and decode steps of a trace. Capture traces for CUDA-graph
    attribution: `capture_paths`, else (with find_captures) `capture_bs*` files beside the
    trace, plus any capture recorded in the trace itself. ValueError on bad input."""
    events = load_trace(trace_path)
    if capture_paths is None and find_captures:
        capture_paths = find_capture_traces(trace_path)
    captures = graph_captures(events, str(trace_path)) + load_graph_captures(list(capture_paths or []))
    attribution = attribute_kernels(events, captures)
    _check_layer(attribution, layer)
    phases, notes = {}, list(attribution.notes)
    for phase in PHASES:
        breakdown = phase_breakdown(attribution, phase, layer)
        if breakdown is None and phase == "decode":
            raise ValueError(f"no decode step in {trace_path}: expected a range named 'atom_step[decode] ...'")
        if breakdown is None:
            notes.append("no prefill step in the trace; prefill_breakdown.xlsx not written")
        else:
            phases[phase] = breakdown
    if not any(layer_index(k.module) is not None for k in attribution.kernels):
        notes.append("the trace has no layers.N module ranges; re-run with --mark-trace")
    sources = sorted({c.source for c in captures})
    return TraceBreakdown(str(trace_path), layer, phases, attribution.uses_cpu_rule, sources, notes)


def _check_layer(attribution: Attribution, layer: int) -> None:
    layers = sorted({i for k in attribution.kernels if (i := layer_index(k.module)) is not None})
    if layer < 0 or (layers and layer not in layers):
        known = f"{layers[0]}..{layers[-1]}" if layers else "none"
        raise ValueError(f"layer {layer} out of range; the trace has layers {known}")


def phase_breakdown(attribution: Attribution, phase: Phase, layer: int) -> PhaseBreakdown | None:
    """The sheets of one phase, or None when the trace has no step of that phase with kernels."""
    by_step: dict[int, list[KernelRecord]] = defaultdict(list)
    for k in attribution.kernels:
        by_step[k.step].append(k)
    steps = [s for s in attribution.steps if s.phase == phase and by_step[s.index]]
    if not steps:
        return None
    signature = {s.index: tuple((k.module, k.kernel) for k in by_step[s.index]) for s in steps}
    counts = Counter(signature[s.index] for s in steps)
    chosen = max(counts, key=lambda sig: (counts[sig], -next(s.index for s in steps if signature[s.index] == sig)))
    averaged = [s.index for s in steps if signature[s.index] == chosen]
    rows = [
        (module, kernel, sum(by_step[i][pos].dur for i in averaged) / len(averaged))
        for pos, (module, kernel) in enumerate(chosen)
    ]
    full = _with_module_sums(rows)
    sheets = {
        f"layer_{layer}": _with_module_sums([r for r in rows if layer_index(r[0]) == layer]),
        "all_layers_avg": _with_module_sums(_average_layers(rows)),
        "full_step": full,
        "summary": _summary(rows),
        "steps": pd.DataFrame(
            [
                (s.index, s.name, s.dur, sum(k.dur for k in by_step[s.index]), len(by_step[s.index]), s.index in averaged)
                for s in steps
            ],
            columns=STEPS_COLUMNS,
        ),
    }
    return PhaseBreakdown(phase, layer, sheets, len(steps), len(averaged))


def _with_module_sums(rows: list[tuple[str, str, float]]) -> pd.DataFrame:
    """Rows (module, kernel, duration) as a table; each run of one module gets its sum on its first row."""
    sums: list[float | None] = []
    group_start = 0
    for i, (module, _, dur) in enumerate(rows):
        if i == 0 or module != rows[i - 1][0]:
            group_start = i
            sums.append(dur)
        else:
            sums[group_start] += dur
            sums.append(None)
    table = pd.DataFrame(rows, columns=BREAKDOWN_COLUMNS[:3])
    table[BREAKDOWN_COLUMNS[3]] = pd.Series(sums, dtype="float64")
    return table


def _average_layers(rows: list[tuple[str, str, float]]) -> list[tuple[str, str, float]]:
    """Layer rows with normalized names; the k-th (module, kernel) of a layer summed over the
    layers and divided by the number of layers (a layer without it counts 0), so that the
    rows add up to the mean time of one layer."""
    totals: dict[tuple[str, str, int], float] = {}
    seen: Counter = Counter()
    layers = set()
    for module, kernel, dur in rows:
        layer = layer_index(module)
        if layer is None:
            continue
        layers.add(layer)
        name = normalize_layer(module)
        seen[(layer, name, kernel)] += 1
        key = (name, kernel, seen[(layer, name, kernel)])
        totals[key] = totals.get(key, 0.0) + dur
    return [(name, kernel, total / len(layers)) for (name, kernel, _), total in totals.items()]


def _summary(rows: list[tuple[str, str, float]]) -> pd.DataFrame:
    total_by_type = {t: [0.0, 0] for t in MODULE_TYPES}
    for module, kernel, dur in rows:
        bucket = total_by_type[module_type(module, kernel)]
        bucket[0] += dur
        bucket[1] += 1
    total = sum(d for d, _ in total_by_type.values())
    table = [(t, d, 100.0 * d / total if total else 0.0, n) for t, (d, n) in total_by_type.items()]
    table.append(("total", total, 100.0 if total else 0.0, len(rows)))
    return pd.DataFrame(table, columns=SUMMARY_COLUMNS)
