"""Every Triton kernel compiles for AMD Instinct GPUs (gfx942: MI300; gfx950: MI350) with Triton's AMD
backend, offline: no ROCm runtime or GPU is needed, only triton/backends/amd (its LLVM and lld are bundled).

The launches compiled are the kernel tests' own (types, constexprs, num_warps), recorded under the
interpreter into rocm_launches.json; after changing a kernel's arguments, record them again:

    python -m pytest -q -p tests.kernels.rocm_capture tests/kernels tests/quant
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels.rocm_compile import LAUNCHES

REPO = Path(__file__).resolve().parents[2]
HAS_AMD_BACKEND = importlib.util.find_spec("triton") is not None and \
    importlib.util.find_spec("triton.backends.amd") is not None
pytestmark = pytest.mark.skipif(not HAS_AMD_BACKEND, reason="Triton's AMD backend (triton/backends/amd) is not installed")

ARCHS = ("gfx942", "gfx950")
# Kernels that are NVIDIA-only by design: a sibling serves every other target.
CUDA_ONLY = {
    "atom_core.kernels.triton.fp8_w8a16:_w8a16_ptx_kernel": "inline PTX (e4m3 widening); _w8a16_kernel is its sibling",
    "atom_core.kernels.triton.w4a16_gemv_f16x2:_w4a16_gemv_f16x2_kernel": "inline PTX (packed half2); _w4a16_gemv_kernel "
                                                                          "is its sibling",
}
# Kernels that do not compile for an arch today, with the compiler's reason; a fixed one fails the test
# until it leaves this table.
KNOWN_FAILURES: dict[tuple[str, str], str] = {}


def _kernel_names() -> set[str]:
    """module:name of every @triton.jit function named *_kernel in atom_core/kernels/triton."""
    from triton.runtime.autotuner import Autotuner, Heuristics

    import atom_core.kernels.triton as package

    names = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for value in vars(module).values():
            while isinstance(value, (Autotuner, Heuristics)):
                value = value.fn
            fn = getattr(value, "fn", None)
            if fn is not None and fn.__module__ == module.__name__ and fn.__name__.endswith("_kernel"):
                names.add(f"{module.__name__}:{fn.__name__}")
    return names


def test_every_kernel_has_a_recorded_launch():
    recorded = set(json.loads(LAUNCHES.read_text()))
    assert _kernel_names() - recorded - set(CUDA_ONLY) == set(), \
        "a kernel no interpreter test launches: add a CPU test of it, then record the launches again"
    assert recorded <= _kernel_names(), "recorded launches of kernels that are gone: record them again"


@pytest.fixture(scope="module", params=ARCHS)
def compiled(request, tmp_path_factory) -> tuple[str, dict[str, str]]:
    arch = request.param
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compiler needs JITFunctions
    env.update(TRITON_CACHE_DIR=str(tmp_path_factory.mktemp(f"triton-{arch}")), CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-m", "tests.kernels.rocm_compile", arch], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return arch, json.loads(run.stdout.strip().splitlines()[-1])


def test_kernels_compile_for_amd(compiled):
    arch, results = compiled
    failures = {key: error for key, error in results.items() if error != "ok"}
    expected = {key: reason for (a, key), reason in KNOWN_FAILURES.items() if a == arch}
    assert set(failures) == set(expected), json.dumps(failures, indent=1)
