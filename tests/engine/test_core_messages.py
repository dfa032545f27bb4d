"""Messages from the engine core to the API process survive pickling field for field."""
from __future__ import annotations

import gc
import pickle

from atom_core.engine.async_engine import Outputs, freeze_startup_objects
from atom_core.engine.output_processor import CoreOutput


def test_outputs_round_trip_with_every_field():
    plain = [CoreOutput(f"req-{i}", [i, i + 1], num_cached_tokens=i % 3) for i in range(5)]
    rich = [
        CoreOutput("first", [7], queue_time=0.25, prefill_time=0.5, prompt_logprobs=[None, (-1.5, {3: -1.5})]),
        CoreOutput("stopped", [9, 2], True, "stop", 2, [(-0.1, {9: -0.1}), (-0.2, {2: -0.2})], None, 16),
        CoreOutput("length", [], True, "length"),
    ]
    msg = Outputs(plain[:2] + rich + plain[2:], 123.5)
    back = pickle.loads(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
    assert back == msg
    assert isinstance(back.outputs[0], CoreOutput) and back.sent_at == 123.5
    back.outputs[0].new_logprobs.append(1)  # each output owns its lists
    assert back.outputs[1].new_logprobs == []


def test_an_empty_step_round_trips():
    assert pickle.loads(pickle.dumps(Outputs([], 0.0))) == Outputs([], 0.0)


def test_startup_objects_leave_the_collectors_reach():
    before = gc.get_freeze_count()
    kept = [[i] for i in range(1000)]  # noqa: F841 - alive across the freeze
    freeze_startup_objects()
    assert gc.get_freeze_count() >= before + 1000
    gc.unfreeze()  # the rest of the test session collects as usual
