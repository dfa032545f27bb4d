"""benchmarks/kernels/lora_bench.py off the GPU: its sweep's plans compute the product (interpreter,
small shapes), its floor counts what the kernels must move, and bad arguments are a clear error."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from atom_core.kernels import lora_ref
from atom_core.kernels.triton import lora as triton_lora
from benchmarks.kernels import lora_bench

ROOT = Path(__file__).resolve().parents[2]


def test_sweep_plans_are_distinct_valid_and_compute_the_product():
    plans = lora_bench.sweep_plans(5, 2048, 32)
    assert len(plans) == len(set(plans)) == 24 and {s.split_k for s, _ in plans} == {8, 16, 32}
    assert len(lora_bench.sweep_plans(5, 700, 32)) == 16  # 16 and 32 slices of 64-multiples of 700 are both 11
    g = torch.Generator().manual_seed(3)
    x, a = torch.randn(5, 2048, generator=g), torch.randn(3, 32, 2048, generator=g)
    b, y = torch.randn(3, 48, 16, generator=g), torch.randn(5, 48, generator=g)
    meta = lora_ref.lora_layout(torch.tensor([2, -1, 0, 2, 1], dtype=torch.int32), 3)
    want = y.clone()
    lora_ref.lora_expand(want, lora_ref.lora_shrink(x, a, meta), b, meta, (0, 24, 48), 16)
    for shrink, expand in plans:
        got = y.clone()
        triton_lora.lora_expand(got, triton_lora.lora_shrink(x, a, meta, shrink), b, meta, (0, 24, 48), 16, expand)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3, msg=str((shrink, expand)))


def test_floor_counts_tables_of_the_used_slots_and_the_activations():
    one = lora_bench.floor_us(4096, 16, 4096, 1, 1, 16, 1, 1.0)
    assert one == pytest.approx((16 * 4096 * 2 + 4096 * 16 * 2 + 4096 * 2 + 2 * 4096 * 2 + 2 * 16 * 4) / 1e6)
    assert lora_bench.floor_us(4096, 16, 4096, 1, 8, 16, 1, 1.0) > 7 * one


@pytest.mark.parametrize("args", [["--m", "0"], ["--floor-tbs", "-1"], ["--rank", "0", "--sweep"]])
def test_bad_arguments_are_a_clear_error(args):
    run = subprocess.run([sys.executable, "-m", "benchmarks.kernels.lora_bench", *args], capture_output=True,
                         text=True, cwd=ROOT)
    assert run.returncode == 2 and "must be positive" in run.stderr
