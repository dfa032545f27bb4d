"""The host-overhead harness runs the real engine path with a stubbed model."""
from benchmarks.engine.host_overhead import host_ms_per_step


def test_reports_a_positive_step_time(tiny_llama):
    ms = host_ms_per_step(str(tiny_llama), batch=8, steps=10, runs=1)
    assert 0 < ms < 1000
