"""Where the device sits idle inside and between engine steps, from a CUDA-only trace (diagnostic).

`trace_gaps.py` reads a full profiler trace, whose CPU-side events inflate the host's cost several
fold. This reads a trace taken with `ProfilerActivity.CUDA` alone (kernel, memcpy and memset records,
a few us of profiler cost a launch) in which each step starts with a marker kernel
(`torch.cuda._sleep`, "spin_kernel"; diag_mixed_steps.py --cuda-trace issues it). Per step: its span
on the device (marker to next marker), the union of its kernels (busy), and the idle rest, split into
the idle before its first kernel (the host had not issued it yet) and the idle between its kernels;
and the kernel pairs around the largest idle gaps.
"""
from __future__ import annotations

import gzip
import json
from collections import defaultdict

MARKER = "spin_kernel"
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def device_records(path: str) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every kernel / memcpy / memset, sorted by start."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    out = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e.get("name", ""))
           for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS]
    return sorted(out)


def short(name: str) -> str:
    if name.startswith(("Memcpy", "Memset")):  # keep the direction: "Memcpy HtoD (Pinned -> Device)"
        return name[:40]
    for cut in ("<", "(", " "):
        name = name.split(cut)[0]
    return name[:48]


def split_steps(records, kinds: list[str]) -> list[dict]:
    """Per step between markers: kind, span, busy, idle before its first kernel, idle between kernels,
    and its gaps as (us, previous kernel, next kernel)."""
    marks = [i for i, r in enumerate(records) if MARKER in r[2]]
    steps = []
    for n, (a, b) in enumerate(zip(marks, marks[1:])):
        body = records[a + 1:b]
        if not body:
            continue
        span = records[b][0] - records[a][0]
        first_idle = body[0][0] - records[a][1]
        busy, end, gaps = 0.0, body[0][0], []
        prev = body[0][2]
        for s, e, name in body:
            if s > end:
                gaps.append((s - end, short(prev), short(name)))
            busy += max(0.0, e - max(s, end))
            if e > end:
                end, prev = e, name
        tail = records[b][0] - end  # idle after its last kernel, before the next step's marker
        steps.append({"kind": kinds[n] if n < len(kinds) else "?", "span": span, "busy": busy,
                      "first_idle": max(0.0, first_idle), "tail_idle": max(0.0, tail), "gaps": gaps})
    return steps


def report(path: str, kinds: list[str], top: int = 12) -> None:
    steps = split_steps(device_records(path), kinds)
    groups = defaultdict(list)
    for st in steps:
        groups[st["kind"]].append(st)
    print(f"{'step kind':24s} {'steps':>5s} {'span ms':>8s} {'busy ms':>8s} {'idle %':>7s} {'before':>7s} "
          f"{'inside':>7s} {'after':>7s}")
    for kind, rows in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        n = len(rows)
        mean = lambda key: sum(r[key] for r in rows) / n / 1e3  # noqa: E731
        inside = sum(sum(g[0] for g in r["gaps"]) for r in rows) / n / 1e3
        print(f"{kind:24s} {n:5d} {mean('span'):8.2f} {mean('busy'):8.2f} "
              f"{100 * (1 - mean('busy') / mean('span')):6.1f}% {mean('first_idle'):7.2f} {inside:7.2f} "
              f"{mean('tail_idle'):7.2f}")
    pairs = defaultdict(lambda: [0, 0.0])
    for st in steps:
        for us, a, b in st["gaps"]:
            pairs[(a, b)][0] += 1
            pairs[(a, b)][1] += us
    print(f"\nidle inside steps by kernel pair (top {top} by total), over {len(steps)} steps:")
    for (a, b), (count, us) in sorted(pairs.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {us / 1e3:8.2f} ms {count:6d} gaps {us / max(count, 1):7.1f} us  {a} -> {b}")
