"""Loading Chrome traces (.json / .json.gz) and finding the range around a point in time.

Only complete events (`"ph": "X"`, with `ts` and `dur` in microseconds) matter to the parser;
metadata, counters and instant events are dropped on load.
"""
from __future__ import annotations

import gzip
import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True, slots=True)
class TraceEvent:
    name: str
    cat: str
    ts: float  # microseconds
    dur: float  # microseconds
    pid: int | str
    tid: int | str
    args: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def end(self) -> float:
        return self.ts + self.dur

    @property
    def thread(self) -> tuple[int | str, int | str]:
        return (self.pid, self.tid)

    @property
    def correlation(self) -> int | None:
        return self.args.get("correlation")


def load_trace(path: str | Path) -> list[TraceEvent]:
    """The complete events of a Chrome trace file. ValueError if it is not one."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"trace file not found: {path}")
    with path.open("rb") as raw:
        is_gzip = raw.read(2) == b"\x1f\x8b"
    try:
        with (gzip.open(path, "rt", encoding="utf-8") if is_gzip else path.open(encoding="utf-8")) as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a Chrome trace (.json or .json.gz): {e}") from e
    return trace_events_from_json(data, source=str(path))


def trace_events_from_json(data: object, source: str = "trace") -> list[TraceEvent]:
    """The complete events of a parsed Chrome trace ({"traceEvents": [...]} or a bare list)."""
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ValueError(f"{source} is not a Chrome trace: no 'traceEvents' list")
    out = []
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        ts, dur = e.get("ts"), e.get("dur")
        if not isinstance(ts, (int, float)) or not isinstance(dur, (int, float)):
            continue
        args = e.get("args")
        out.append(
            TraceEvent(
                name=str(e.get("name", "")),
                cat=str(e.get("cat", "")),
                ts=float(ts),
                dur=float(dur),
                pid=e.get("pid", 0),
                tid=e.get("tid", 0),
                args=args if isinstance(args, dict) else {},
            )
        )
    return out


def innermost_enclosing(ranges: Iterable[TraceEvent], points: Sequence[TraceEvent]) -> list[TraceEvent | None]:
    """For each point event, the innermost range on the same thread that contains its start.

    Ranges on one thread nest properly (record_function is a stack), so one sweep in start
    order with a stack of open ranges answers every query. Result is aligned with `points`.
    """
    by_thread: dict[tuple, list[tuple[float, int, float, int]]] = defaultdict(list)
    range_list = list(ranges)
    # Sort key: start; a range before a point at the same time; longer (outer) ranges first.
    for i, r in enumerate(range_list):
        by_thread[r.thread].append((r.ts, 0, -r.dur, i))
    for j, p in enumerate(points):
        by_thread[p.thread].append((p.ts, 1, 0.0, j))
    result: list[TraceEvent | None] = [None] * len(points)
    for items in by_thread.values():
        items.sort()
        stack: list[TraceEvent] = []
        for ts, kind, _, index in items:
            while stack and stack[-1].end < ts:
                stack.pop()
            if kind == 0:
                stack.append(range_list[index])
            elif stack:
                result[index] = stack[-1]
    return result


def self_times(events: Sequence[TraceEvent]) -> list[tuple[TraceEvent, float]]:
    """Each event with its self time: its duration less that of the events nested directly
    inside it on the same thread. Self times of nested events add up to the outer duration."""
    by_thread: dict[tuple, list[TraceEvent]] = defaultdict(list)
    for e in events:
        by_thread[e.thread].append(e)
    own: dict[int, float] = {}
    for items in by_thread.values():
        items.sort(key=lambda e: (e.ts, -e.dur))
        stack: list[TraceEvent] = []
        for e in items:
            while stack and stack[-1].end < e.ts:
                stack.pop()
            own[id(e)] = e.dur
            if stack:  # ops nest properly: an op starting inside another is its child
                own[id(stack[-1])] -= e.dur
            stack.append(e)
    return sorted(((e, own[id(e)]) for e in events), key=lambda pair: pair[0].ts)
