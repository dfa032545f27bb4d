"""benchmarks/plugin/dist_info.py: the dist-info that lets vLLM on the GPU machine (no pip install there)
find our plugin, read back through importlib.metadata as vLLM reads it."""
from __future__ import annotations

import importlib.metadata

import pytest

from atom_core import plugin
from benchmarks.plugin.dist_info import ROOT, read_project, write_dist_info


def test_importlib_finds_the_plugin_entry_point_pyproject_declares(tmp_path):
    dist_info = write_dist_info(tmp_path)
    (dist,) = importlib.metadata.distributions(path=[str(tmp_path)])
    project = read_project(ROOT / "pyproject.toml")
    assert (dist.metadata["Name"], dist.version) == (project["name"], project["version"])
    assert dist_info.name == f"atomctl-{project['version']}.dist-info"
    points = {(e.group, e.name, e.value) for e in dist.entry_points}
    declared = {(g, n, v) for g, table in project["entry-points"].items() for n, v in table.items()}
    assert declared <= points and ("vllm.general_plugins", "atom_core", "atom_core.plugin:register") in points
    assert ("console_scripts", "atomctl", project["scripts"]["atomctl"]) in points
    (vllm_plugin,) = [e for e in dist.entry_points if e.group == "vllm.general_plugins"]
    assert vllm_plugin.load() is plugin.register
    write_dist_info(tmp_path)  # again: replaced in place, still one distribution
    assert len(list(importlib.metadata.distributions(path=[str(tmp_path)]))) == 1


def test_a_project_without_entry_points_is_refused(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "x"\nversion = "1"\n')
    with pytest.raises(ValueError, match="declares no entry points"):
        write_dist_info(tmp_path / "out", pyproject)
