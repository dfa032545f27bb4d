"""Host-side helpers shared by the Triton kernels."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from atom_core.kernels.triton.common import next_pow2, pin_triton_cache_dir  # noqa: E402


def test_pin_triton_cache_dir_uses_inductors_folder_unless_set(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert pin_triton_cache_dir(0) == str(tmp_path / "triton" / "0")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/else")
    assert pin_triton_cache_dir(0) == "/somewhere/else"


def test_next_pow2():
    assert [next_pow2(n) for n in (0, 1, 2, 3, 16, 17)] == [1, 1, 2, 4, 16, 32]
