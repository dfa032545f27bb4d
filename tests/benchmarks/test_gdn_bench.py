"""benchmarks/kernels/gdn_bench.py: its rows build and run end to end on the CPU (Triton's interpreter) at
small head counts, so a GPU run of it fails only on the GPU's own account."""
from __future__ import annotations

import math

import pytest
import torch

from benchmarks.kernels import gdn_bench


@pytest.fixture
def small_bench(monkeypatch):
    """One q/k head, two v heads of width 32, on the CPU; each timed function runs once."""
    calls = []
    for name, value in (("DEVICE", "cpu"), ("HK", 1), ("HV", 2), ("DK", 32), ("DV", 32)):
        monkeypatch.setattr(gdn_bench, name, value)
    monkeypatch.setattr(gdn_bench, "CHANNELS", 2 * 1 * 32 + 2 * 32)  # q, k and v

    def run_once(fn):
        calls.append(fn())
        return 1.0

    monkeypatch.setattr(gdn_bench, "bench_ms", run_once)
    return calls


def test_prefill_and_decode_rows_run(small_bench):
    rows = gdn_bench.bench_prefill("2x65") + gdn_bench.bench_decode(3)
    assert [r["name"] for r in rows] == ["chunk_gated_delta_rule 2x65", "causal_conv1d 2x65",
                                         "fused_recurrent_gated_delta_rule bs=3", "causal_conv1d decode bs=3"]
    assert len(small_bench) == 4 and all(math.isfinite(out.float().sum().item()) for out in small_bench)
    assert all(r["us"] == 1e3 and r["floor_us"] > 0 for r in rows)
    assert rows[0]["tflop_s"] > 0 and rows[0]["intermediate_bytes_not_counted"] > 0


@pytest.mark.parametrize("k_dim", [16, 64])
def test_transpose_dot_probe_computes_the_state_update(k_dim):
    from benchmarks.kernels.gdn_transpose_dot_probe import probe

    assert probe(k_dim, device="cpu", dtype=torch.float32) < 1e-5  # the interpreter's fp32 dot is exact enough
