"""Run an import-time switch in a fresh interpreter, as a user's shell would set it."""
from __future__ import annotations

import os
import subprocess
import sys


def run_with_env(code: str, name: str, value: str) -> subprocess.CompletedProcess:
    """`python -c code` with `name`=`value` and no other ATOM_* or TRITON_INTERPRET variable
    (the test run's own settings would leak into what the import reads)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ATOM_", "TRITON_INTERPRET"))}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**env, name: value})
