"""Attribute the kernels of an atom_core trace to engine steps and model modules.

Rules, in order:

1. Steps are the `atom_step[prefill|decode] ...` ranges (see conventions.py). Kernels whose
   launch lies outside every step (warm-up, profiler start-up) are ignored.
2. GPU traces: each GPU event (cat `kernel`, `gpu_memcpy`, `gpu_memset`) is tied to the CPU
   call that launched it (cat `cuda_runtime` / `cuda_driver`) through `args.correlation`. The
   launch's thread and start time give the step and the module: the innermost module range
   (any other `user_annotation` range) on that thread containing the launch. GPU timing is
   never used for this, since kernels run late relative to their launches.
3. CUDA-graph replays: a `cudaGraphLaunch` with many kernels correlated to it. Its k-th kernel
   (GPU start order) takes the module of the k-th launch inside the capture of the same batch
   size (`graph_bs=` of the step, else `bs=`) from a capture trace (profiler.py explains the
   capture). Without a matching capture (none given, none beside the trace, or a different
   kernel count) the kernels are reported under the module `<cuda graph>`.
4. CPU traces (no GPU events at all): every CPU op (cat `cpu_op`) stands in for a kernel with
   its self time (its duration less that of the CPU ops directly inside it); ops with no self
   time are left out. The op's start gives step and module. Self times add up without double
   counting, so a module's sum is the time its ops took. (Leaf ops alone would not do: on the
   CPU `aten::mm` calls `aten::resolve_conj`, so the leaf is the no-op and the matmul is lost.)
5. A kernel with no module range around its launch gets the module `<no module>`.
"""
from __future__ import annotations

import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from atom_core.profiling.conventions import (
    CAPTURE_FILE_PREFIX,
    Phase,
    is_reserved_range,
    parse_graph_capture_name,
    parse_step_name,
)
from atom_core.profiling.trace_events import TraceEvent, innermost_enclosing, load_trace, self_times

GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
LAUNCH_CATS = frozenset({"cuda_runtime", "cuda_driver", "hip_runtime"})
RANGE_CAT = "user_annotation"
CPU_OP_CAT = "cpu_op"
GRAPH_LAUNCH_RE = re.compile(r"GraphLaunch")
CAPTURE_LAUNCH_RE = re.compile(r"LaunchKernel|LaunchCooperativeKernel|Memcpy\w*Async|Memset\w*Async")
NO_MODULE = "<no module>"
GRAPH_MODULE = "<cuda graph>"
GRAPH_HINT = (
    "decode kernels ran inside CUDA graphs and could not be attributed to modules; re-run with --mark-trace"
)
_TRACE_NAME_RE = re.compile(r"^(?P<model>.+)_\d{8}_\d{6}_\d{3}\.pt\.trace\.json(\.gz)?$")


@dataclass(frozen=True)
class Step:
    index: int
    phase: Phase
    name: str
    fields: dict[str, int]
    ts: float
    dur: float


@dataclass(frozen=True)
class KernelRecord:
    step: int  # Step.index
    module: str
    kernel: str
    ts: float  # GPU start (CPU start under the CPU rule), microseconds
    dur: float  # microseconds


@dataclass(frozen=True)
class GraphCapture:
    batch_size: int
    modules: tuple[str, ...]  # module of the k-th launch captured into the graph
    source: str


@dataclass
class Attribution:
    steps: list[Step]
    kernels: list[KernelRecord]  # in start order
    uses_cpu_rule: bool
    notes: list[str] = field(default_factory=list)


def find_capture_traces(trace_path: str | Path) -> list[Path]:
    """Capture traces beside `trace_path`, newest first; when the trace is named
    `{model}_{timestamp}.pt.trace.json.gz`, only the captures of that model."""
    trace_path = Path(trace_path)
    found = [p for p in trace_path.parent.glob(f"{CAPTURE_FILE_PREFIX}*.json*") if p != trace_path]
    found.sort(key=lambda p: (os.path.getmtime(p), p.name), reverse=True)
    match = _TRACE_NAME_RE.match(trace_path.name)
    if match is None:
        return found
    prefix = re.compile(rf"^{CAPTURE_FILE_PREFIX}\d+_{re.escape(match['model'])}_\d{{8}}_")
    return [p for p in found if prefix.match(p.name)]


def graph_captures(events: list[TraceEvent], source: str) -> list[GraphCapture]:
    """The graph captures recorded in a trace: for each `atom_graph_capture bs=N` range, the
    modules of the launches made on its thread while the stream was capturing (between
    *StreamBeginCapture and *StreamEndCapture when present, else the whole range)."""
    capture_ranges = [e for e in events if e.cat == RANGE_CAT and parse_graph_capture_name(e.name) is not None]
    if not capture_ranges:
        return []
    module_ranges = _module_ranges(events)
    launch_like = [e for e in events if e.cat in LAUNCH_CATS]
    captures = []
    for cap in capture_ranges:
        inside = sorted(
            (e for e in launch_like if e.thread == cap.thread and cap.ts <= e.ts <= cap.end), key=lambda e: e.ts
        )
        begins = [e.ts for e in inside if "StreamBeginCapture" in e.name]
        ends = [e.ts for e in inside if "StreamEndCapture" in e.name]
        start, stop = (min(begins), max(ends)) if begins and ends else (cap.ts, cap.end)
        launches = [e for e in inside if start <= e.ts <= stop and CAPTURE_LAUNCH_RE.search(e.name)]
        modules = innermost_enclosing(module_ranges, launches)
        names = tuple(m.name if m is not None else NO_MODULE for m in modules)
        captures.append(GraphCapture(parse_graph_capture_name(cap.name), names, source))
    return captures


def load_graph_captures(paths: list[str | Path]) -> list[GraphCapture]:
    captures = []
    for path in paths:
        found = graph_captures(load_trace(path), str(path))
        if not found:
            raise ValueError(f"{path} holds no 'atom_graph_capture bs=N' range; it is not a capture trace")
        captures.extend(found)
    return captures


def attribute_kernels(events: list[TraceEvent], captures: list[GraphCapture] = ()) -> Attribution:
    """Steps and per-kernel module attribution of one trace (rules in the module doc)."""
    steps = _steps(events)
    if not steps:
        raise ValueError(
            "no engine steps in the trace: expected record_function ranges named "
            "'atom_step[prefill] ...' / 'atom_step[decode] ...' (recorded by atom_core's engine)"
        )
    if any(e.cat in GPU_CATS for e in events):
        attribution = _attribute_gpu(events, steps, list(captures))
    else:
        attribution = _attribute_cpu(events, steps)
    if not attribution.kernels:
        what = "CPU ops" if attribution.uses_cpu_rule else "GPU kernels launched"
        raise ValueError(f"no kernels in the trace: found {len(steps)} engine steps but no {what} inside them")
    return attribution


def _steps(events: list[TraceEvent]) -> list[Step]:
    steps = []
    for e in sorted(events, key=lambda e: e.ts):
        parsed = parse_step_name(e.name) if e.cat == RANGE_CAT else None
        if parsed is not None:
            steps.append(Step(len(steps), parsed[0], e.name, parsed[1], e.ts, e.dur))
    return steps


def _module_ranges(events: list[TraceEvent]) -> list[TraceEvent]:
    return [e for e in events if e.cat == RANGE_CAT and not is_reserved_range(e.name)]


def _step_ranges(events: list[TraceEvent]) -> list[TraceEvent]:
    return [e for e in events if e.cat == RANGE_CAT and parse_step_name(e.name) is not None]


def _attribute_cpu(events: list[TraceEvent], steps: list[Step]) -> Attribution:
    ops = [(op, own) for op, own in self_times([e for e in events if e.cat == CPU_OP_CAT]) if own > 0]
    points = [op for op, _ in ops]
    step_of = _step_index_of(events, steps, points)
    module_of = innermost_enclosing(_module_ranges(events), points)
    kernels = [
        KernelRecord(step_of[i], module_of[i].name if module_of[i] else NO_MODULE, op.name, op.ts, own)
        for i, (op, own) in enumerate(ops)
        if step_of[i] is not None
    ]
    return Attribution(steps, kernels, uses_cpu_rule=True)


def _attribute_gpu(events: list[TraceEvent], steps: list[Step], captures: list[GraphCapture]) -> Attribution:
    launches = {e.correlation: e for e in events if e.cat in LAUNCH_CATS and e.correlation is not None}
    by_launch: dict[int, list[TraceEvent]] = defaultdict(list)
    for e in events:
        if e.cat in GPU_CATS and e.correlation in launches:
            by_launch[e.correlation].append(e)
    launch_list = [launches[c] for c in by_launch]
    step_of = _step_index_of(events, steps, launch_list)
    module_of = innermost_enclosing(_module_ranges(events), launch_list)
    kernels: list[KernelRecord] = []
    unmatched_replays: list[str] = []
    for i, launch in enumerate(launch_list):
        if step_of[i] is None:
            continue
        gpu_events = sorted(by_launch[launch.correlation], key=lambda e: e.ts)
        if GRAPH_LAUNCH_RE.search(launch.name):
            modules = _graph_modules(steps[step_of[i]], len(gpu_events), captures, unmatched_replays)
        else:
            modules = [module_of[i].name if module_of[i] else NO_MODULE] * len(gpu_events)
        kernels.extend(KernelRecord(step_of[i], m, e.name, e.ts, e.dur) for m, e in zip(modules, gpu_events))
    kernels.sort(key=lambda k: k.ts)
    return Attribution(steps, kernels, uses_cpu_rule=False, notes=_graph_notes(unmatched_replays, captures))


def _step_index_of(events: list[TraceEvent], steps: list[Step], points: list[TraceEvent]) -> list[int | None]:
    index_by_start = {(s.ts, s.name): s.index for s in steps}
    enclosing = innermost_enclosing(_step_ranges(events), points)
    return [index_by_start[(r.ts, r.name)] if r is not None else None for r in enclosing]


def _graph_modules(step: Step, num_kernels: int, captures: list[GraphCapture], unmatched: list[str]) -> list[str]:
    """Modules for the kernels of one graph replay, from the capture of the same batch size."""
    bs = step.fields.get("graph_bs", step.fields.get("bs"))
    for capture in captures:
        if capture.batch_size == bs and len(capture.modules) == num_kernels:
            return list(capture.modules)
    unmatched.append(f"bs={bs} with {num_kernels} kernels")
    return [GRAPH_MODULE] * num_kernels


def _graph_notes(unmatched: list[str], captures: list[GraphCapture]) -> list[str]:
    if not unmatched:
        return []
    if not captures:
        return [GRAPH_HINT]
    available = ", ".join(sorted({f"bs={c.batch_size} ({len(c.modules)} launches)" for c in captures}))
    wanted = ", ".join(sorted(set(unmatched)))
    return [
        f"{len(unmatched)} CUDA-graph replays ({wanted}) matched no capture trace (captures: {available}); "
        f"their kernels are reported under {GRAPH_MODULE}"
    ]
