"""A lower bound on DeepSeek-V2-Lite's nano-workload time on one H100 (bf16), counted from the
config and the workload itself (atom_core.bench.offline.ThroughputWorkload, the same requests
`atomctl bench offline` runs), under two routings of the decode batches:

- uniform: each token picks 6 of 64 experts at random, so a batch of b tokens reads
  64 * (1 - (1 - 6/64)**b) experts per MoE layer (what our dummy weights do, and what a
  load-balanced real checkpoint does);
- concentrated: every token of a step picks the same 6 experts (the least a step can read).

Counted: prefill compute at the measured bf16 ceiling (785 TFLOP/s) plus, for every decode step,
the weights it must read (non-expert weights once, routed experts as above) and the latent KV
of every sequence in it, at the measured HBM read ceiling (3.0 TB/s). Every request decodes from
the first decode step (the whole workload fits the KV cache), one token a step. To stay a lower
bound, the decode steps that could ride along the prefill steps (as many as there are
8,192-token prefill steps) are not counted.

    python recipes/deepseek/nano_floor.py
"""
import json
from pathlib import Path

from atom_core.bench.offline import ThroughputWorkload

FLOPS, HBM = 785e12, 3.0e12  # the H100 ceilings measured here (../../docs/PERFORMANCE.md, Floors)
BYTES = 2  # bf16
BUDGET = 8192  # max_num_batched_tokens: tokens per prefill step


def main() -> None:
    cfg = json.loads((Path(__file__).parents[2] / "atom_core/presets/DeepSeek-V2-Lite/config.json").read_text())
    h, layers, dense = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["first_k_dense_replace"]
    heads, rope, nope, v = (cfg[k] for k in ("num_attention_heads", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"))
    rank, experts, top_k = cfg["kv_lora_rank"], cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    moe_layers = layers - dense
    attn = h * heads * (nope + rope) + h * (rank + rope) + rank * heads * (nope + v) + heads * v * h
    expert = 3 * h * cfg["moe_intermediate_size"]
    shared = cfg["n_shared_experts"] * expert
    dense_mlp = 3 * h * cfg["intermediate_size"]
    head = cfg["vocab_size"] * h
    fixed_bytes = BYTES * (layers * attn + dense * dense_mlp + moe_layers * (shared + experts * h) + head)
    kv_per_token = layers * (rank + rope) * BYTES
    flops_per_token = 2 * (layers * attn + dense * dense_mlp + moe_layers * (top_k * expert + shared))

    prompts, params = ThroughputWorkload().build()
    prompt_lens = [len(p) for p in prompts]
    outputs = [p.max_tokens for p in params]
    prefill_s = sum(prompt_lens) * flops_per_token / FLOPS
    skipped = -(-sum(prompt_lens) // BUDGET)

    print(f"{len(prompts)} requests, {sum(prompt_lens):,} prompt tokens, {sum(outputs):,} output tokens")
    print(f"per decode step: non-expert weights {fixed_bytes / 1e9:.2f} GB; an expert {expert * BYTES / 1e6:.1f} MB "
          f"x {moe_layers} MoE layers; KV {kv_per_token:,} B per token of context")
    print(f"prefill: {flops_per_token / 1e9:.2f} GFLOP per token -> {prefill_s:.2f} s at {FLOPS / 1e12:.0f} TFLOP/s; "
          f"the first {skipped} decode steps are not counted (they may ride along the prefill steps)")
    for routing in ("uniform", "concentrated"):
        decode_s = 0.0
        for step in range(skipped, max(outputs)):
            active = [i for i, n in enumerate(outputs) if n - 1 > step]  # the first output token comes from the prefill
            if not active:
                break
            b = len(active)
            touched = experts * (1 - (1 - top_k / experts) ** b) if routing == "uniform" else min(experts, top_k)
            kv = sum(prompt_lens[i] + step for i in active) * kv_per_token
            decode_s += (fixed_bytes + moe_layers * touched * expert * BYTES + kv) / HBM
        total = prefill_s + decode_s
        print(f"{routing:12s}: decode steps {decode_s:.2f} s, total >= {total:.2f} s -> "
              f"<= {sum(outputs) / total:,.0f} output tok/s")


if __name__ == "__main__":
    main()
