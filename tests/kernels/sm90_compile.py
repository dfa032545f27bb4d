"""Offline sm_90 compile checks for kernel tests (Triton's bundled toolchain; no GPU needed).

    kernel = triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32), options=...)
    assert stack_bytes(kernel) == 0   # no local-memory spills

Pass the 16-divisibility Triton gives pointers and row strides at launch as `attrs` of the
ASTSource (`tt.divisibility`), else loads stay scalar and register use is not what a GPU sees.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton


def cuobjdump_path() -> str | None:
    """Triton's bundled cuobjdump, or None where this Triton ships none."""
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return path if os.path.exists(path) else None


def stack_bytes(kernel) -> int:
    """The compiled kernel's per-thread stack (local memory: spills) from `cuobjdump -res-usage`."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump_path(), "-res-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    return int(re.search(r"STACK:(\d+)", usage).group(1))


def sass(kernel) -> str:
    """The compiled kernel's SASS (Triton's bundled nvdisasm)."""
    nvdisasm = os.path.join(os.path.dirname(cuobjdump_path()), "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout


def loop_sass(kernel) -> list[str]:
    """The instructions of the kernel's longest loop (a backward branch to a label above it): the
    body whose count per weight bounds a streaming kernel's issue rate."""
    items = []  # (label or None, instruction or None)
    for line in sass(kernel).splitlines():
        if (label := re.match(r"\s*\.(L_x_\d+):", line)) is not None:
            items.append((label.group(1), None))
        elif (ins := re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)) is not None:
            items.append((None, re.sub(r"^@!?U?P\w+\s+", "", ins.group(1))))
    best: list[str] = []
    for end, (_, ins) in enumerate(items):
        target = re.search(r"BRA\s+`?\(?\.(L_x_\d+)", ins or "")
        starts = [i for i, (lab, _) in enumerate(items[:end]) if target and lab == target.group(1)]
        if starts:
            body = [op for _, op in items[starts[0]:end + 1] if op is not None]
            best = body if len(body) > len(best) else best
    return best
