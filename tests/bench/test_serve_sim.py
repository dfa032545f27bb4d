"""The serve simulator: the real scheduler under a closed loop, timed by a step-cost model."""
import dataclasses
import json

import pytest

from benchmarks.engine.serve_sim import COST_PRESETS, StepCost, main, simulate, step_cost
from atom_core.config import SchedulerConfig
from atom_core.scheduler_output import SchedulerOutput

# Every step (and every forward of a decode window) costs exactly 10 ms.
FLAT_10MS = StepCost(gemm_floor_ms=0, gemm_ms_per_token=0, kv_bytes_per_token=0, attn_flops_per_token_pair=0,
                     small_ms_per_token=0, head_floor_ms=0, head_ms_per_row=0,
                     decode_only_overhead_ms=10, mixed_overhead_ms=10)


def _config(r: int = 0, budget: int = 8192, steps: int = 8) -> SchedulerConfig:
    return SchedulerConfig(max_num_batched_tokens=budget, num_scheduler_steps=steps, mixed_step_tokens_per_seq=r)


def test_every_request_completes_with_exact_token_counts():
    result = simulate(_config(r=8), StepCost(), concurrency=16, num_requests=48, input_len=300, output_len=20)
    assert result.num_requests == 48
    assert result.output_tokens == 48 * 20
    assert len(result.ttft_ms) == len(result.tpot_ms) == 48
    assert min(result.ttft_ms) > 0 and min(result.tpot_ms) > 0
    assert result.num_preemptions == 0
    summary = result.summary()
    assert summary["output_tok_s"] > 0 and summary["steps"] == len(result.steps)


@pytest.mark.parametrize("window", [1, 8])
def test_clock_and_async_order_by_hand(window):
    """c1, two requests of 300 prompt tokens and 5 outputs, 128-token budget, 10 ms a forward.
    Request 0: chunks 128 / 128 / 44 end at 10 / 20 / 30 ms (the next chunk is scheduled while the
    previous one runs), so its first token is at 30 ms; the four decodes follow 10 ms apart (one step
    each, or one window of 4 forwards, 30-70 ms): it finishes at 70. Request 1 is sent 1 ms later
    (client latency) and repeats it: arrival 71, finish 141."""
    result = simulate(_config(budget=128, steps=window), FLAT_10MS, concurrency=1, num_requests=2,
                      input_len=300, output_len=5)
    assert result.ttft_ms == pytest.approx([30.0, 30.0])
    assert result.tpot_ms == pytest.approx([10.0, 10.0])
    assert result.duration_ms == pytest.approx(141.0)
    assert result.output_tok_s == pytest.approx(10 / 0.141)
    assert len(result.steps) == 2 * (3 + (4 if window == 1 else 1))
    # bench serve's ITL: one gap per chunk of tokens, a window's 4 tokens arriving as one
    assert result.itl_ms == pytest.approx([10.0] * 8 if window == 1 else [40.0] * 2)


@pytest.mark.parametrize("window", [1, 8])
def test_answers_that_stop_at_eos_by_hand(window):
    """As above, but each answer ends with EOS as its 5th token and sets no max_tokens. One step at a time:
    request 0's tokens come at 30, 40, ... 70; the step launched before its EOS was read runs 70-80 for
    nothing, so request 1 (sent at 71) starts at 80: first token at 110. Windows: they grow with the answer
    (1, 2, 4 forwards: tokens at 40, 60, 100 with EOS in the last), and the 8-forward window launched before
    the EOS was read holds the device to 180: request 1 arrives at 101 and gets its first token at 210."""
    result = simulate(_config(budget=128, steps=window), FLAT_10MS, concurrency=1, num_requests=2, input_len=300,
                      output_len=5, stop_at_eos=True)
    assert result.output_tokens == 10
    if window == 1:
        assert result.ttft_ms == pytest.approx([30.0, 39.0]) and result.tpot_ms == pytest.approx([10.0, 10.0])
        assert result.duration_ms == pytest.approx(150.0)
    else:
        assert result.ttft_ms == pytest.approx([30.0, 109.0]) and result.tpot_ms == pytest.approx([17.5, 17.5])
        assert result.duration_ms == pytest.approx(280.0)
        assert [s.forwards for s in result.steps] == [1, 1, 1, 1, 2, 4, 8] * 2


def test_open_loop_requests_come_at_their_own_times():
    """--request-rate: Poisson arrivals whatever finishes. At one request every ~10 s none overlaps, so
    each sees an idle server (first token after its three chunks, 30 ms); the run lasts until the last one
    ends, far past what a closed loop of one client would take."""
    result = simulate(_config(budget=128, steps=1), FLAT_10MS, concurrency=1, num_requests=4, input_len=300,
                      output_len=5, request_rate=0.1)
    assert result.num_requests == 4 and result.output_tokens == 20
    assert result.ttft_ms == pytest.approx([30.0] * 4) and result.tpot_ms == pytest.approx([10.0] * 4)
    assert result.duration_ms > 1000
    with pytest.raises(ValueError, match="request-rate"):
        simulate(_config(), FLAT_10MS, concurrency=1, num_requests=2, input_len=30, output_len=2, request_rate=0)


def test_host_time_of_building_a_step_delays_its_start():
    """A mixed step takes 25 ms of host time to build, a decode-only one 2 ms, every forward 10 ms on the
    device: the three prompt chunks start at 25, 50, 75 (host-bound), first token at 85; the decodes
    (built while the chunk runs) follow 10 ms apart."""
    cost = dataclasses.replace(FLAT_10MS, host_mixed_ms=25.0, host_decode_ms=2.0)
    result = simulate(_config(budget=128, steps=1), cost, concurrency=1, num_requests=1, input_len=300, output_len=5)
    assert result.ttft_ms == pytest.approx([85.0])
    assert result.tpot_ms == pytest.approx([10.0])


def test_host_bound_steps_pace_the_tokens():
    """15 ms of host work after each launch, 10 ms steps: the host schedules at 0, 15, 30, 45, ...
    and each step starts when scheduled; step 3 (the last chunk, 30-40 ms) is read at 45, when the
    host is next free, and each later token 15 ms apart: TTFT 45, TPOT 15 (the host's pace)."""
    result = simulate(_config(budget=128, steps=1), FLAT_10MS, concurrency=1, num_requests=1, input_len=300,
                      output_len=5, host_overhead_ms=15.0)
    assert result.ttft_ms == pytest.approx([45.0])
    assert result.tpot_ms == pytest.approx([15.0])


def test_mixed_step_cap_bounds_the_steps():
    """R = 8 at c64: a step with decodes carries about 8 x 64 = 512 tokens (to the 128 granule), never
    the budget; without the cap prompt chunks fill the 8,192-token budget beside the decodes."""
    kwargs = dict(concurrency=64, num_requests=192, input_len=1024, output_len=128)
    capped = simulate(_config(r=8), StepCost(), **kwargs).summary()
    uncapped = simulate(_config(r=0), StepCost(), **kwargs).summary()
    assert capped["mixed_steps"] > 100
    assert capped["mixed_tokens"] <= 512 + 128
    assert capped["mixed_max_tokens"] <= 512 + 128
    assert uncapped["mixed_max_tokens"] > 2000


def test_deterministic_for_a_seed():
    def run():
        return simulate(_config(r=8), StepCost(), concurrency=8, num_requests=24, input_len=200, output_len=16, seed=3)

    a, b = run(), run()
    assert a.ttft_ms == b.ttft_ms and a.tpot_ms == b.tpot_ms and a.steps == b.steps
    assert {**a.summary(), "sim_s": 0} == {**b.summary(), "sim_s": 0}


def test_step_cost_of_a_mixed_step_by_hand():
    """Two decodes at positions 99 and 199 and a 100-token chunk from 0; every coefficient 1-ish."""
    out = SchedulerOutput()
    out.add("a", 1, 99)
    out.add("b", 1, 199)
    out.add("c", 100, 0)
    cost = dataclasses.replace(StepCost(), gemm_floor_ms=0, gemm_ms_per_token=1, kv_bytes_per_token=1,
                               decode_attn_bytes_per_s=1e3, attn_flops_per_token_pair=1, prefill_attn_flops=1e3,
                               small_ms_per_token=0.5, head_floor_ms=0, head_ms_per_row=2, mixed_overhead_ms=1.5)
    # gemm 102, decode attention 300, prefill attention 100 x 50 = 5,000, small 51, head 3 x 2, mixed 1.5
    assert step_cost(out, [1, 1, 1], cost) == pytest.approx(102 + 300 + 5000 + 51 + 6 + 1.5)


def test_unknown_cost_field_is_rejected():
    with pytest.raises(ValueError, match="gemm_us_per_token"):
        StepCost.from_json('{"gemm_us_per_token": 0.02}')
    assert StepCost.from_json('{"gemm_floor_ms": 5}').gemm_floor_ms == 5


def test_cost_overrides_apply_to_the_chosen_preset():
    cost = StepCost.from_json('{"gemm_floor_ms": 5}', COST_PRESETS["h200"])
    assert cost.gemm_floor_ms == 5 and cost.host_mixed_ms == COST_PRESETS["h200"].host_mixed_ms > 0


def test_the_prefill_hold_trades_first_token_for_tokens_after_it():
    """c128 closed loop, H200 model: holding prompts until 0.4 of the streams are starting prefills them in
    waves beside few decodes, so the time per output token falls and the first token comes later than with
    prompts admitted at once (the same policy otherwise); the mixed-step cap gets the first token earliest."""
    kwargs = dict(concurrency=128, num_requests=384, input_len=1024, output_len=128, client_latency_ms=20.0)
    cost = COST_PRESETS["h200"]
    results = {name: simulate(SchedulerConfig(num_scheduler_steps=1, **fields), cost, **kwargs).summary()
               for name, fields in (("hold", {"prefill_hold_fraction": 0.4}), ("at once", {}),
                                    ("cap", {"mixed_step_tokens_per_seq": 8}))}
    hold, at_once, cap = results["hold"], results["at once"], results["cap"]
    assert hold["tpot_p50_ms"] < 0.9 * at_once["tpot_p50_ms"] and hold["ttft_p50_ms"] > at_once["ttft_p50_ms"]
    assert cap["ttft_p50_ms"] < at_once["ttft_p50_ms"] and cap["itl_p50_ms"] > 2 * hold["itl_p50_ms"]


class TestCommandLine:
    """python -m benchmarks.engine.serve_sim: a table row or a JSON line per R; bad input is a usage error."""

    ARGS = ["--concurrency", "4", "--num-prompts", "8", "--input-len", "64", "--output-len", "4"]

    def test_table_row_per_policy_and_swept_r(self, capsys):
        main(self.ARGS + ["--policy", 'held={"prefill_hold_fraction": 0.5}', "--sweep", "0,8"])
        lines = capsys.readouterr().out.strip().splitlines()
        assert lines[0].startswith("policy | output_tok_s") and len(lines) == 4
        assert [line.split(" | ")[0] for line in lines[1:]] == ["held", "R=0", "R=8"]

    def test_json_line_of_serve_default_with_cost_override(self, capsys):
        main(self.ARGS + ["--json", "--cost", "h100", "--cost-json", '{"mixed_overhead_ms": 0}'])
        (line,) = capsys.readouterr().out.strip().splitlines()
        row = json.loads(line)
        assert row["policy"] == "serve default" and row["requests"] == 8 and row["output_tok_s"] > 0
        assert row["itl_p50_ms"] > 0

    @pytest.mark.parametrize("flags,message", [
        (["--sweep", "a,8"], "--sweep takes a comma list of integers"),
        (["--cost-json", '{"nope": 1}'], "unknown StepCost field"),
        (["--cost-json", '{"gemm_floor_ms": "5"}'], "need numbers"),
        (["--cost-json", "[1]"], "must be a JSON object"),
        (["--cost-json", "{bad"], "Expecting property name"),
        (["--sweep", "-1"], "mixed_step_tokens_per_seq"),
        (["--policy", "nolabel"], "LABEL=JSON"),
        (["--policy", "x=[1]"], "LABEL=JSON"),
        (["--policy", 'x={"no_such_field": 1}'], "no_such_field"),
        (["--policy", 'x={"prefill_hold_fraction": 2}'], "prefill_hold_fraction"),
        (["--cost", "h300"], "invalid choice"),
        (["--request-rate", "-2"], "--request-rate must be > 0"),
    ])
    def test_bad_input_is_a_usage_error(self, capsys, flags, message):
        with pytest.raises(SystemExit) as exit_info:
            main(self.ARGS + flags)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
