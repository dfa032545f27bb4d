"""Gated DeltaNet kernels at Qwen3-Next shapes (16 q/k heads, 32 v heads, head dims 128, bf16, fp32
state), one layer: the chunked prefill, the recurrent decode step, and the causal conv beside each.

    python -m benchmarks.kernels.gdn_bench [--prefill 1x8192,4x2048] [--decode-bs 1,32,128] [--out f.json]

Time: CUDA-graph replays (no host syncs in any of these ops), median. Floors, per call:
  prefill  max(FLOPs / peak, essential bytes / bandwidth). FLOPs count the chunked form's matmuls per
           chunk of 64 and v head (prep: K K^T, T K, T V; state scan: W S, K^T V_new; outputs: Q H,
           Q K^T, A V_new); essential bytes are q, k, v, g, beta in, o out, and each sequence's state
           read and written once (the W, U, v_new and per-chunk state intermediates that the three
           kernels write and read back are reported, not counted).
  decode   bytes / bandwidth: the state read and written (32 x 128 x 128 fp32 a sequence) plus q, k, v, o.
  conv     bytes / bandwidth: x in, y out, the conv state read and written.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from atom_core.kernels import triton as triton_ops
from atom_core.kernels.gdn_ref import CHUNK_SIZE
from benchmarks.kernels.bench_kernels import bench_ms

HK, HV, DK, DV, WIDTH = 16, 32, 128, 128, 4
CHANNELS = 2 * HK * DK + HV * DV
PEAK_TFLOPS = 785.0  # measured bf16 dense matmul on this SM generation (DESIGN.md)
HBM_TBS = 4.3  # H200 measured device-to-device copy rate (docs/PERFORMANCE.md)
DEVICE = "cuda"  # tests/benchmarks/test_gdn_bench.py runs the rows on the CPU (Triton's interpreter)


def make_batch(lens: list[int], has_init: bool):
    num_tokens, num_seqs = sum(lens), len(lens)
    dev, bf16 = DEVICE, torch.bfloat16
    q, k = (torch.randn(num_tokens, HK, DK, device=dev, dtype=bf16) for _ in range(2))
    v = torch.randn(num_tokens, HV, DV, device=dev, dtype=bf16)
    g = -torch.nn.functional.softplus(torch.randn(num_tokens, HV, device=dev)) * 0.1
    beta = torch.rand(num_tokens, HV, device=dev, dtype=bf16)
    state = torch.randn(num_seqs, HV, DK, DV, device=dev) * 0.01
    meta = (torch.arange(num_seqs, dtype=torch.int32, device=dev),
            torch.tensor([0] + lens, device=dev).cumsum(0).to(torch.int32),
            torch.full((num_seqs,), has_init, dtype=torch.bool, device=dev))
    x = torch.randn(num_tokens, CHANNELS, device=dev, dtype=bf16)
    conv = (x, torch.randn(CHANNELS, WIDTH, device=dev, dtype=bf16), None,
            torch.randn(num_seqs, CHANNELS, WIDTH - 1, device=dev, dtype=bf16))
    return (q, k, v, g, beta, state, *meta), conv + meta


def rule_bytes(num_tokens: int, num_seqs: int) -> int:
    per_token = 2 * (2 * HK * DK + 2 * HV * DV) + 4 * HV + 2 * HV  # q, k, v, o bf16; g fp32; beta bf16
    return num_tokens * per_token + num_seqs * 2 * HV * DK * DV * 4


def prefill_flops(num_tokens: int) -> int:
    c = CHUNK_SIZE
    per_token_head = 2 * c * DK + 2 * c * DK + 2 * c * DV  # prep: K K^T, T (beta e^G K), T (beta V)
    per_token_head += 2 * 2 * DK * DV  # state scan: W S, K^T V_new
    per_token_head += 2 * DK * DV + 2 * c * DK + 2 * c * DV  # outputs: Q H, Q K^T, A V_new
    return num_tokens * HV * per_token_head


def conv_bytes(num_tokens: int, num_seqs: int) -> int:
    return 2 * num_tokens * CHANNELS * 2 + 2 * num_seqs * CHANNELS * (WIDTH - 1) * 2


def row(name: str, ms: float, nbytes: int, flops: int = 0) -> dict:
    floor_us = max(flops / (PEAK_TFLOPS * 1e12), nbytes / (HBM_TBS * 1e12)) * 1e6
    out = dict(name=name, us=ms * 1e3, gb_s=nbytes / ms / 1e6, floor_us=floor_us, of_floor=floor_us / (ms * 1e3))
    if flops:
        out["tflop_s"] = flops / ms / 1e9
    return out


def bench_prefill(spec: str) -> list[dict]:
    num_seqs, length = (int(p) for p in spec.split("x"))
    rule_args, conv_args = make_batch([length] * num_seqs, has_init=False)
    num_tokens = num_seqs * length
    scale = DK ** -0.5
    ms = bench_ms(lambda: triton_ops.chunk_gated_delta_rule(*rule_args, scale=scale))
    num_chunks = num_tokens // CHUNK_SIZE + num_seqs  # the chunk-state buffer the wrapper allocates
    # W, U, v_new and the chunk start states, bf16, each written once and read once
    intermediates = (num_tokens * HV * (DK + 2 * DV) + num_chunks * HV * DK * DV) * 2 * 2
    rule = row(f"chunk_gated_delta_rule {spec}", ms, rule_bytes(num_tokens, num_seqs), prefill_flops(num_tokens))
    rule["intermediate_bytes_not_counted"] = intermediates
    conv_ms = bench_ms(lambda: triton_ops.causal_conv1d(*conv_args))
    return [rule, row(f"causal_conv1d {spec}", conv_ms, conv_bytes(num_tokens, num_seqs))]


def bench_decode(bs: int) -> list[dict]:
    rule_args, conv_args = make_batch([1] * bs, has_init=True)
    scale = DK ** -0.5
    ms = bench_ms(lambda: triton_ops.fused_recurrent_gated_delta_rule(*rule_args, scale=scale))
    conv_ms = bench_ms(lambda: triton_ops.causal_conv1d(*conv_args))
    return [row(f"fused_recurrent_gated_delta_rule bs={bs}", ms, rule_bytes(bs, bs)),
            row(f"causal_conv1d decode bs={bs}", conv_ms, conv_bytes(bs, bs))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prefill", default="1x8192,4x2048,16x512", help="NUM_SEQSxLENGTH, comma-separated")
    parser.add_argument("--decode-bs", default="1,32,128")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = [r for spec in args.prefill.split(",") for r in bench_prefill(spec)]
    rows += [r for bs in args.decode_bs.split(",") for r in bench_decode(int(bs))]
    print(f"{torch.cuda.get_device_name()}: gated DeltaNet, one layer (Hk={HK} Hv={HV} Dk={DK} Dv={DV}, bf16); "
          f"floor = max(FLOPs / {PEAK_TFLOPS:.0f} TFLOP/s, bytes / {HBM_TBS} TB/s)")
    print(f"{'kernel':48s} {'us':>9s} {'GB/s':>8s} {'TFLOP/s':>8s} {'floor us':>9s} {'of floor':>8s}")
    for r in rows:
        tflops = f"{r['tflop_s']:8.1f}" if "tflop_s" in r else f"{'':8s}"
        print(f"{r['name']:48s} {r['us']:9.1f} {r['gb_s']:8.0f} {tflops} {r['floor_us']:9.1f} {r['of_floor']:8.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
