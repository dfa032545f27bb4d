"""The import contracts in pyproject.toml ([tool.importlinter]) hold: the package layering, kernels/
free of the layers above it, no cycle between the modules of a package, no CLI or vLLM import."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the backport import-linter itself depends on
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"


def _lint(config: Path, source: Path) -> subprocess.CompletedProcess:
    """`lint-imports` over the packages under `source` (first on the path, not an installed copy)."""
    env = {**os.environ, "PYTHONPATH": str(source)}
    cmd = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())",
           "--config", str(config), "--no-cache"]
    return subprocess.run(cmd, cwd=config.parent, env=env, capture_output=True, text=True, timeout=300)


def _contracts() -> list[dict]:
    return tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]


def test_every_contract_is_kept():
    result = _lint(PYPROJECT, ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_the_layers_name_every_package_and_module_of_atom_core():
    """A new package must take a place in the layering, or nothing would check its imports."""
    layers = next(c for c in _contracts() if c["type"] == "layers")["layers"]
    named = {name.strip() for layer in layers for name in re.split(r"[|:]", layer)}
    children = {f"atom_core.{p.stem if p.is_file() else p.name}" for p in (ROOT / "atom_core").iterdir()
                if (p.is_file() and p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").exists()}
    assert children - named == set(), "atom_core modules missing from the layers contract"
    assert {n for n in named if n.startswith("atom_core.")} - children == set(), "layers name modules that do not exist"


@pytest.mark.parametrize("importer, imported, contract", [
    ("atom_core.kernels.torch_ref", "atom_core.quant.fp8_ops", "kernels/ imports nothing"),
    ("atom_core.config", "atom_core.models.registry", "layers, top to bottom"),
    ("atom_core.kernels.triton.fp8", "atom_core.kernels.triton.fp8_gemm", "no import cycle"),
])
def test_a_forbidden_import_breaks_its_contract(tmp_path, importer, imported, contract):
    """The contracts can fail: a copy of the package with one added import (a function-level one,
    which counts as any other) breaks the contract named."""
    copy = tmp_path / "src"
    for pkg in ("atom_core", "atomctl"):
        shutil.copytree(ROOT / pkg, copy / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.safetensors"))
    module = copy.joinpath(*importer.split(".")).with_suffix(".py")
    module.write_text(module.read_text() + f"\n\ndef _added():\n    import {imported}  # noqa: F401\n")
    config = tmp_path / "pyproject.toml"
    config.write_text(PYPROJECT.read_text())
    result = _lint(config, copy)
    assert result.returncode != 0, result.stdout
    broken = result.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken, result.stdout
