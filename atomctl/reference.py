"""The configuration reference (docs/CONFIGURATION.md), generated from the live Typer app and envs.ENV_VARS.

    python -m atomctl.reference > docs/CONFIGURATION.md

`tests/cli/test_reference.py` fails when the checked-in file differs from what this prints, so a new or
changed flag, default, help text or ATOM_* variable reaches the docs with the change that made it.
Types are spelled from the option's Python annotation (or click's type where typer keeps one), so
the page does not depend on which typer version renders the help.
"""
from __future__ import annotations

import math
import pathlib
import re
import typing
from typing import Any

import typer

REGENERATE = "python -m atomctl.reference > docs/CONFIGURATION.md"

# Options typer adds to every app for shell completion: not atomctl's, and they differ between typer versions.
_SKIPPED = {"install_completion", "show_completion", "help"}
_CLICK_TYPE_NAMES = {"text": "TEXT", "integer": "INTEGER", "float": "FLOAT", "boolean": "BOOLEAN", "path": "PATH"}
_PY_TYPE_NAMES = {str: "TEXT", int: "INTEGER", float: "FLOAT", bool: "BOOLEAN", pathlib.Path: "PATH"}


def configuration_reference() -> str:
    """The whole page: the shared engine options, every command with its own options, every ATOM_* variable."""
    from atomctl.engine_options import ENGINE_OPTIONS
    from atomctl.main import app

    root = typer.main.get_command(app)
    commands = _commands(root)
    engine_names = set(ENGINE_OPTIONS)
    with_engine = [path for path, command in commands if engine_names <= {p.name for p in command.params}]
    lines = [
        "# Configuration reference",
        "",
        f"Generated from the `atomctl` Typer app and `atom_core/envs.py` by `{REGENERATE}`; do not edit by hand",
        "(`tests/cli/test_reference.py` fails when this file is stale). `atomctl COMMAND --help` prints the same",
        "options. An engine option left at its default is not passed on, so the engine applies its own default,",
        "which for some options depends on the command (the help says where).",
        "",
    ]
    if with_engine:
        first = dict(commands)[with_engine[0]]
        lines += ["## Engine options", "",
                  "Shared by " + ", ".join(f"`{' '.join(path)}`" for path in with_engine) + ".", ""]
        lines += _option_table([p for p in first.params if p.name in engine_names])
    lines += ["## Commands", ""]
    for path, command in commands:
        own_names = engine_names if path in with_engine else set()
        lines += _command_section(path, command, own_names)
    lines += _env_section()
    return "\n".join(lines).rstrip("\n") + "\n"


def _commands(group: Any, prefix: tuple[str, ...] = ("atomctl",)) -> list[tuple[tuple[str, ...], Any]]:
    """(command path, click command) for the group itself and everything under it, names sorted."""
    out = [(prefix, group)]
    for name in sorted(group.commands):
        command = group.commands[name]
        if command.hidden:
            continue
        if hasattr(command, "commands"):
            out += _commands(command, (*prefix, name))
        else:
            out.append(((*prefix, name), command))
    return out


def _command_section(path: tuple[str, ...], command: Any, engine_names: set[str]) -> list[str]:
    params = [p for p in command.params
              if p.name not in _SKIPPED and p.name not in engine_names and not getattr(p, "hidden", False)]
    lines = [f"### `{' '.join(path)}`", ""]
    if command.help:
        lines += [_paragraphs(command.help), ""]
    if hasattr(command, "commands"):
        names = ", ".join(f"`{name}`" for name in sorted(command.commands))
        lines += [f"Subcommands: {names}.", ""]
    if engine_names:
        lines += ["Takes the [engine options](#engine-options)" + (", and:" if params else "."), ""]
    return lines + (_option_table(params) if params else [])


def _option_table(params: list[Any]) -> list[str]:
    lines = ["| option | type | default | description |", "|---|---|---|---|"]
    for param in params:
        lines.append(f"| {_flags(param)} | {_type_name(param)} | {_default(param)} | {_cell(param.help or '')} |")
    return lines + [""]


def _flags(param: Any) -> str:
    if param.param_type_name == "argument":
        return f"`{param.name.upper()}` (argument)"
    flags = [*param.opts, *param.secondary_opts]
    return " ".join(f"`{flag}`" for flag in flags)


def _type_name(param: Any) -> str:
    if getattr(param, "is_flag", False):
        return "flag"
    click_type = getattr(param, "type", None)
    if click_type is not None:
        name = _CLICK_TYPE_NAMES.get(click_type.name, click_type.name.upper())
    else:
        name = _annotation_name(param.type_descriptor.annotation)
    if param.multiple or (param.param_type_name == "argument" and param.nargs == -1):
        name += ", repeatable"
    return name


def _annotation_name(annotation: Any) -> str:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Annotated:
        return _annotation_name(args[0])
    if args:  # Optional[X], List[X]
        return _annotation_name(args[0])
    return _PY_TYPE_NAMES.get(annotation, getattr(annotation, "__name__", str(annotation)).upper())


def _default(param: Any) -> str:
    value = param.default
    if param.required:
        return "required"
    if value is None or value == () or value == []:
        return ""
    if getattr(param, "is_flag", False) and param.secondary_opts:
        return f"`{(param.opts if value else param.secondary_opts)[0]}`"
    if isinstance(value, float) and math.isinf(value):
        return "`inf`"
    if isinstance(value, (list, tuple)):
        return "`" + ",".join(str(v) for v in value) + "`"
    return f"`{value}`"


def _env_section() -> list[str]:
    from atom_core.envs import ENV_VARS

    lines = [
        "## Environment variables",
        "",
        "Read once at start in `atom_core/envs.py`; a malformed value is an error naming the variable.",
        "Booleans take 1/0, true/false, yes/no or on/off; unset or empty means the default.",
        "",
        "| variable | description |",
        "|---|---|",
    ]
    lines += [f"| `{name}` | {_cell(text)} |" for name, text in sorted(ENV_VARS.items())]
    return lines + [""]


def _paragraphs(text: str) -> str:
    """A docstring as markdown: paragraphs kept, each on one line."""
    return "\n\n".join(_one_line(part) for part in re.split(r"\n\s*\n", text.strip()) if part.strip())


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _cell(text: str) -> str:
    """Help text as one markdown table cell: one line, pipes escaped."""
    return _one_line(text).replace("|", "\\|")


if __name__ == "__main__":
    print(configuration_reference(), end="")
