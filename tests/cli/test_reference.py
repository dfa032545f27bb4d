"""docs/CONFIGURATION.md is what `python -m atomctl.reference` prints from the live app, and it covers everything."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import typer

from atom_core.envs import ENV_VARS
from atomctl.engine_options import ENGINE_OPTIONS
from atomctl.main import app
from atomctl.reference import REGENERATE, configuration_reference

ROOT = Path(__file__).resolve().parents[2]
CHECKED_IN = ROOT / "docs" / "CONFIGURATION.md"


@pytest.fixture(scope="module")
def page() -> str:
    return configuration_reference()


def leaf_commands(group, prefix=("atomctl",)):
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            yield from leaf_commands(command, (*prefix, name))
        else:
            yield (*prefix, name), command


class TestCheckedInFile:
    def test_matches_the_live_app(self, page):
        assert CHECKED_IN.read_text() == page, f"docs/CONFIGURATION.md is stale; regenerate it: {REGENERATE}"

    def test_module_entry_point_prints_the_page(self, page):
        out = subprocess.run([sys.executable, "-m", "atomctl.reference"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
        assert out == page


class TestCoverage:
    def test_every_command_has_a_section(self, page):
        for path, _ in leaf_commands(typer.main.get_command(app)):
            assert f"### `{' '.join(path)}`" in page

    def test_every_option_of_every_command_is_listed(self, page):
        for path, command in leaf_commands(typer.main.get_command(app)):
            for param in command.params:
                if param.name == "help":
                    continue
                flag = f"`{param.opts[0]}`" if param.param_type_name == "option" else f"`{param.name.upper()}`"
                assert flag in page, f"{' '.join(path)}: {flag} missing"

    def test_engine_options_are_listed_once_and_referenced(self, page):
        engine_part, commands_part = page.split("## Commands", 1)
        with_engine = [(path, command) for path, command in leaf_commands(typer.main.get_command(app))
                       if set(ENGINE_OPTIONS) <= {p.name for p in command.params}]
        assert with_engine
        engine_rows = {line for line in engine_part.splitlines() if line.startswith("| `")}
        names = {f"`{p.opts[0]}`" for p in with_engine[0][1].params if p.name in ENGINE_OPTIONS}
        assert {row.split(" ")[1] for row in engine_rows} == names
        for section in commands_part.split("\n### ")[1:]:
            if "Takes the [engine options]" in section:  # its own options only, not the shared ones again
                assert not engine_rows & set(section.splitlines()), section.splitlines()[0]
        assert commands_part.count("Takes the [engine options](#engine-options)") == len(with_engine)

    def test_every_environment_variable_is_listed(self, page):
        env_part = page.split("## Environment variables", 1)[1]
        for name in ENV_VARS:
            assert f"| `{name}` |" in env_part

    def test_defaults_and_types_are_rendered(self, page):
        assert "| `--max-num-batched-tokens` | INTEGER | `8192` |" in page
        assert "| `--enable-prefix-caching` `--no-enable-prefix-caching` | flag | `--enable-prefix-caching` |" in page
        assert "| `--request-rate` | FLOAT | `inf` |" in page
        assert "| `TRACE` (argument) | PATH | required |" in page
        assert "| `--stop` | TEXT, repeatable |" in page

    def test_completion_options_of_typer_are_left_out(self, page):
        assert "--install-completion" not in page
