"""GPU memory sizing runs one max-size step before any KV exists for the proposer's layers (its
cache is allocated after sizing): that step must run the target alone. The H100 run of the MTP
GPU tests failed here ('KV cache not allocated for this attention layer'); the CPU sizes KV
without a step, so this test recreates the GPU's order directly."""
import pytest

from atom_core import LLMEngine
from atom_core.loader.model_dir import DEMO_MODEL_DIR
from atom_core.model_ops.kv_spec import release_kv_cache


@pytest.mark.parametrize("spec", [dict(method="mtp", num_speculative_tokens=2),
                                  dict(method="draft", draft_model=str(DEMO_MODEL_DIR), num_speculative_tokens=2)],
                         ids=["mtp", "draft"])
def test_peak_step_runs_before_the_proposer_has_kv(spec):
    runner = LLMEngine(str(DEMO_MODEL_DIR), max_num_batched_tokens=64, max_num_seqs=4, **spec).core.executor.runner
    proposer = runner.proposer
    release_kv_cache(proposer.kv_layers())  # as on a GPU before sizing: the proposer has no cache yet
    assert runner._run_peak_step() > 0
    assert runner.proposer is proposer  # restored after the step
