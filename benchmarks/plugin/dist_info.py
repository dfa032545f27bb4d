"""Make a vLLM that cannot pip-install atomctl (the GPU machine: no network, vLLM unpacked on PYTHONPATH)
find our plugin as it would after `pip install`: write `atomctl-<version>.dist-info` (METADATA, and
entry_points.txt with every entry point pyproject.toml declares, its scripts as console_scripts) into
DIR, which then goes on PYTHONPATH beside the checkout. vLLM lists `vllm.general_plugins` through
importlib.metadata, which reads exactly these two files.

Usage: python3 -m benchmarks.plugin.dist_info DIR   (prints the dist-info path)
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def read_project(pyproject: Path) -> dict:
    import tomllib  # Python >= 3.11: only this tool needs it (the package supports 3.10)

    with open(pyproject, "rb") as f:
        return tomllib.load(f)["project"]


def entry_points_txt(project: dict) -> str:
    """entry_points.txt of `project` (pyproject's [project] table), in the INI form pip writes."""
    groups = dict(project.get("entry-points", {}))
    if project.get("scripts"):
        groups["console_scripts"] = project["scripts"]
    return "".join(f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in points.items()) + "\n"
                   for group, points in groups.items())


def write_dist_info(target: Path, pyproject: Path = ROOT / "pyproject.toml") -> Path:
    """Write (replace) the dist-info of pyproject's project into `target`; returns its path."""
    project = read_project(pyproject)
    name, version = project["name"], project["version"]
    if not project.get("entry-points"):
        raise ValueError(f"{pyproject} declares no entry points: nothing for vLLM to find")
    dist = Path(target) / f"{re.sub(r'[-_.]+', '_', name)}-{version}.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (dist / "entry_points.txt").write_text(entry_points_txt(project))
    (dist / "INSTALLER").write_text("benchmarks.plugin.dist_info\n")
    return dist


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(write_dist_info(Path(sys.argv[1])))
