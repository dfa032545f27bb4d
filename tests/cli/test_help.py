"""`--help` of every atomctl command: fast (it imports the CLI framework and nothing heavier: no torch,
transformers or numpy, no package outside Typer and what Typer requires) and readable at 80 columns (every
flag spelled out in full). What --help imports is the check, not its CPU time: a loaded CI machine stretches
any time budget, while one heavy import is the whole difference between instant and seconds."""
from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata

import pytest
import typer
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from typer.testing import CliRunner

from atomctl.main import app

HEAVY = ("torch", "transformers", "numpy", "triton", "httpx", "atom_core.engine", "atom_core.loader")


def command_paths(group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = [prefix]
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):  # a group (typer ships its own click)
            paths += command_paths(cmd, (*prefix, name))
        else:
            paths.append((*prefix, name))
    return paths


CLICK_APP = typer.main.get_command(app)
PATHS = command_paths(CLICK_APP)

# Runs every --help in one fresh interpreter and reports, after each, every module imported since the
# interpreter started (before atomctl), so a module shows from the first --help that imports it on.
PROBE = """
import json, sys
before = set(sys.modules)
from atomctl.main import app
seen = []
for path in json.loads(sys.argv[1]):
    try:
        app([*path, "--help"])
    except SystemExit:
        pass
    seen.append(sorted(set(sys.modules) - before))
print(json.dumps(seen), file=sys.stderr)
"""


@pytest.fixture(scope="module")
def imported() -> list[list[str]]:
    """Per command path (PATHS), the modules imported by the time its --help has printed."""
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(PATHS)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stderr.strip().splitlines()[-1])


def cli_framework_modules(root: str = "typer") -> set[str]:
    """Top-level modules of `root`'s distribution and of every distribution it requires, transitively
    (optional extras left out), as installed here."""
    dists, todo = set(), [root]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in dists:
            continue
        dists.add(name)
        for line in metadata.requires(name) or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return {module for module, owners in metadata.packages_distributions().items()
            if any(canonicalize_name(owner) in dists for owner in owners)}


class TestHelpIsFast:
    def test_no_help_imports_heavy_modules(self, imported):
        assert len(PATHS) > 8  # every command and sub-command
        for path, modules in zip(PATHS, imported):
            heavy = [h for h in HEAVY if any(m == h or m.startswith(f"{h}.") for m in modules)]
            assert heavy == [], f"`{' '.join(('atomctl', *path))} --help` imported {heavy}"

    def test_help_imports_no_package_past_the_cli_framework(self, imported):
        installed = set(metadata.packages_distributions())  # top-level modules of installed distributions
        allowed = cli_framework_modules() | {"atomctl", "atom_core"}
        assert {"typer", "rich", "torch"} <= installed and {"typer", "rich"} <= allowed
        for path, modules in zip(PATHS, imported):
            extra = sorted({m.split(".")[0] for m in modules} & installed - allowed)
            assert extra == [], f"`{' '.join(('atomctl', *path))} --help` imported {extra}, outside Typer's needs"


class TestHelpAt80Columns:
    @pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "atomctl")
    def test_every_flag_is_spelled_out(self, path):
        result = CliRunner().invoke(app, [*path, "--help"], terminal_width=80, env={"COLUMNS": "80"})
        assert result.exit_code == 0, result.output
        cmd = CLICK_APP
        for name in path:
            cmd = cmd.commands[name]
        for param in cmd.params:
            for flag in (*param.opts, *param.secondary_opts):
                if flag.startswith("-"):
                    assert flag in result.output, f"{flag} missing or cut in `atomctl {' '.join(path)} --help`"
        assert "…" not in result.output
        assert max(len(line) for line in result.output.splitlines()) <= 80


class TestDemoModelRange:
    def test_generate_help_states_the_supported_arithmetic(self):
        result = CliRunner().invoke(app, ["generate", "--help"], terminal_width=80)
        text = " ".join(result.output.split())
        assert "sums and differences of 0-99" in text and "123 + 456" in text
