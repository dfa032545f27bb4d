"""Every file path the docs cite in backticks exists, so the maps stay true as files move."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("docs/ARCHITECTURE.md", "README.md")
TOP_LEVEL = ("atom_core/", "atomctl/", "tests/", "docs/", "recipes/", "benchmarks/", ".ci/")
# `path` or `path:name` (a name inside the file) in backticks, starting at a top-level folder of the repo.
CITED = re.compile(r"`((?:" + "|".join(re.escape(t) for t in TOP_LEVEL) + r")[\w./-]*)(?::\w+)?`")

def cited_paths(text: str) -> list[str]:
    return sorted({match.group(1) for match in CITED.finditer(text)})


class TestCitedPaths:
    @pytest.mark.parametrize("doc", DOCS)
    def test_every_cited_path_exists(self, doc):
        paths = cited_paths((ROOT / doc).read_text())
        assert paths, f"{doc} cites no paths: the pattern no longer matches how it cites them"
        missing = [p for p in paths if not (ROOT / p).exists()]
        assert not missing, f"{doc} cites paths that do not exist: {missing}"


class TestPattern:
    def test_finds_paths_and_strips_a_name_after_a_colon(self):
        text = "see `atom_core/config.py:serving_config`, `atom_core/engine/`, not `pip install` or `a/b.py`"
        assert cited_paths(text) == ["atom_core/config.py", "atom_core/engine/"]
