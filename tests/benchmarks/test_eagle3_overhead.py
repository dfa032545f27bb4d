"""benchmarks/engine/eagle3_overhead.py runs end to end on the CPU (a tiny dummy-weight target and
its random head), so the GPU command cannot fail on a typo."""
from __future__ import annotations

import json

from benchmarks.engine import eagle3_overhead
from tests.tiny_models import build_tiny_model


def test_reports_the_draft_cost_against_a_plain_step(tmp_path, monkeypatch):
    target = build_tiny_model(tmp_path / "target", "llama", num_layers=8)
    out = tmp_path / "eagle3.json"
    monkeypatch.setattr("sys.argv", ["eagle3_overhead", str(target), "--k", "2", "--mtp-graphs", "--output-len", "6",
                                     "--max-model-len", "256", "--draft-vocab", "64", "--profile", "3", "--out", str(out)])
    eagle3_overhead.main()
    result = json.loads(out.read_text())
    assert result["k"] == 2 and result["mtp_graphs"] is True
    assert result["plain_step_ms"] > 0 and result["draft_ms_median"] > 0
    assert abs(result["draft_over_plain_step"] - result["draft_ms_median"] / result["plain_step_ms"]) < 0.01
    assert result["verify_step_ms"] > 0
    assert abs(result["drafting_adds_ms"] - (result["spec_step_ms"] - result["verify_step_ms"])) < 0.002
    assert abs(result["drafting_adds_over_plain_step"] - result["drafting_adds_ms"] / result["plain_step_ms"]) < 0.01
    assert result["spec_decode"]["num_drafts"] > 0 and len(result["spec_decode"]["accepted_per_position"]) == 2
    profile = result["profile"]  # on the CPU: the host's draft ranges and operators, no GPU span or kernels
    assert profile["drafts"] >= 3 and profile["wall_us_per_draft"] > 0
    assert profile["kernels"] == [] and profile["gpu_span_us_per_draft"] is None and profile["kernel_us_per_draft"] == 0
    assert profile["graph_launches_per_draft"] == profile["kernel_launches_per_draft"] == 0  # no CUDA runtime
    ops = {op["name"]: op for op in profile["host_ops"]}
    assert ops and all(op["us_per_draft"] >= 0 for op in ops.values()) and "eagle3.draft" not in ops
    assert sum(op["us_per_draft"] for op in ops.values()) <= profile["wall_us_per_draft"] * 1.05
