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
