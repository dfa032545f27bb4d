"""The serving model's device and host time of one step (benchmarks/engine/serve_sim.py): a cost model
of Llama-3-8B bf16 per GPU, not a measurement. `COST_PRESETS` holds one calibration per GPU; a field
edited asks "what if"."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from atom_core.scheduler_output import SchedulerOutput


@dataclass
class StepCost:
    """Device and host time of one step (ms); the defaults are the H100's (COST_PRESETS has the others)."""

    gemm_floor_ms: float = 5.4  # the weights are read once a step whatever its size
    gemm_ms_per_token: float = 0.0190  # compute-bound linears: 19 us a token (512 rows: 9.7 ms)
    kv_bytes_per_token: float = 131072  # 32 layers x 8 KV heads x 128 x (K, V) x 2 bytes
    decode_attn_bytes_per_s: float = 2.4e12  # the decode kernel's KV read rate at 40-64 sequences
    attn_flops_per_token_pair: float = 4 * 4096 * 32  # QK and PV, hidden 4,096, 32 layers
    prefill_attn_flops: float = 300e12  # achieved by the chunk's causal attention
    small_ms_per_token: float = 0.00225  # SiLU, norms, RoPE, piecewise copies
    head_floor_ms: float = 0.35
    head_ms_per_row: float = 0.0190 / 14  # LM head ~1/14 of the per-token GEMM work
    decode_only_overhead_ms: float = 1.0  # launch gaps of a full-graph replay + sampler
    # eager kernel boundaries between piecewise graphs and what the terms above miss: calibrated on the
    # c64 runs of 2026-11-27 (R = 8: 3,042 modelled against 3,043-3,124 served, TPOT 17.4 / 16.7-17.1)
    mixed_overhead_ms: float = 2.5
    # host time to schedule, build and launch a step before the device can start it (a decode-only step
    # replays one graph; a mixed step launches its eager attention between piecewise graphs, layer by
    # layer): a step starts when both the host has launched it and the device is free
    host_decode_ms: float = 0.0
    host_mixed_ms: float = 0.0

    @classmethod
    def from_json(cls, text: str | None, base: "StepCost | None" = None) -> "StepCost":
        """base (default: the H100's) with the JSON object's fields replaced."""
        overrides = json.loads(text) if text else {}
        if not isinstance(overrides, dict):
            raise ValueError(f"--cost-json must be a JSON object of StepCost fields, got {text!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown StepCost field(s) {unknown}; known: {', '.join(sorted(known))}")
        bad = sorted(k for k, v in overrides.items() if isinstance(v, bool) or not isinstance(v, (int, float)))
        if bad:
            raise ValueError(f"StepCost field(s) {bad} need numbers")
        return dataclasses.replace(base or cls(), **overrides)


def forward_ms(cost: StepCost, num_tokens: int, decode_context: int, chunks: list[tuple[int, int]],
               sampled_rows: int, decode_only: bool) -> float:
    """One forward: num_tokens rows, decodes reading decode_context KV tokens in all, prompt chunks
    (length n, start position p), sampled_rows rows through the LM head."""
    gemm = max(cost.gemm_floor_ms, num_tokens * cost.gemm_ms_per_token)
    decode_attention = decode_context * cost.kv_bytes_per_token / cost.decode_attn_bytes_per_s * 1e3
    # causal: the chunk's token at p + i attends to p + i + 1 keys, n (p + n / 2) pairs in all
    pairs = sum(n * (p + n / 2) for n, p in chunks)
    prefill_attention = pairs * cost.attn_flops_per_token_pair / cost.prefill_attn_flops * 1e3
    small_ops = num_tokens * cost.small_ms_per_token
    head = max(cost.head_floor_ms, sampled_rows * cost.head_ms_per_row)
    overhead = cost.decode_only_overhead_ms if decode_only else cost.mixed_overhead_ms
    return gemm + decode_attention + prefill_attention + small_ops + head + overhead


def step_cost(out: SchedulerOutput, num_sampled: list[int], cost: StepCost) -> float:
    """Device ms of a scheduled step. num_sampled[i]: tokens entry i samples (0: a prompt chunk short
    of its prompt's end). Entries of one token are decodes (context: their position + 1). A decode
    window is its forwards back to back, each costed as a decode-only step (overhead included)."""
    if out.is_window:
        # out.num_steps forwards of every row; a row past its own count re-runs its last position
        counts = [1 + len(extra) for extra in out.extra_tokens]
        contexts = [sum(p + 1 + min(f, c - 1) for p, c in zip(out.num_computed_tokens, counts))
                    for f in range(out.num_steps)]
        return sum(forward_ms(cost, len(out), context, [], len(out), True) for context in contexts)
    decode_context, chunks = 0, []
    for n, p in zip(out.num_scheduled_tokens, out.num_computed_tokens):
        if n == 1:
            decode_context += p + 1
        else:
            chunks.append((n, p))
    sampled_rows = sum(1 for k in num_sampled if k)
    return forward_ms(cost, out.total_tokens, decode_context, chunks, sampled_rows, out.is_decode_only)


def host_build_ms(cost: StepCost, out: SchedulerOutput) -> float:
    """Host time to schedule, build and launch `out` before the device can start it."""
    return cost.host_decode_ms if out.is_decode_only else cost.host_mixed_ms


# One H200 (docs/PERFORMANCE.md, 2026-12-01 sitting). Decode: the batch-32 step (5.23 ms at ~256 tokens of
# context) less its KV and LM head gives the weight floor at small batches; KV at the card's ~4.3 TB/s.
# Compute-bound steps: gemm_ms_per_token and mixed_overhead_ms fitted to serve's c256 run (R = 8: 5,544 tok/s,
# TPOT 42.2 ms; modelled 5,518 / 40.7); the rate is effective (~960 TFLOP/s for 14 GFLOP a token, above the
# ~790 one GEMM measured), so read it as "what the served steps cost", not as a GEMM speed. The c64 run
# (4,164 tok/s, ITL 12.5 ms) is slower than those device terms (4,777 modelled): host_mixed_ms puts that in
# a host-bound mixed step (the H100 trace measured 8.5 ms of host issue for a 512-token one), a hypothesis
# the GPU should confirm (see docs/SERVING.md). With it c64 is 4,304 / TPOT 12.3 / ITL 12.3.
H200 = StepCost(gemm_floor_ms=4.65, gemm_ms_per_token=0.0145, decode_attn_bytes_per_s=4.3e12, prefill_attn_flops=400e12,
                small_ms_per_token=0.0005, head_floor_ms=0.25, head_ms_per_row=0.0011, decode_only_overhead_ms=0.0,
                mixed_overhead_ms=1.0, host_decode_ms=2.0, host_mixed_ms=12.3)
COST_PRESETS = {"h100": StepCost(), "h200": H200}
