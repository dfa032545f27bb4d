"""Named benchmark sets for a GPU machine: `python -m benchmarks.run_set NAME` runs one.

A set is a list of steps, each one command with a time limit. Commands are written as a user types
them (`atomctl bench ...`, `python -m benchmarks.kernels.X ...`); the runner starts `atomctl` and
`python` with its own interpreter, so a checkout runs its own code. `{out}` is the run's output
folder; `{newest:GLOB}` is the newest file matching GLOB when the step starts (a trace the step
before wrote). A set with a `server` starts that `atomctl serve` command first, waits for its
/health, and stops it after the last step.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    name: str
    command: str
    timeout_s: int


@dataclass(frozen=True)
class BenchSet:
    description: str
    steps: tuple[Step, ...]
    server: str | None = None  # an `atomctl serve ... --port N` command the steps talk to


def _dummy(preset: str) -> str:
    return f"--model preset:{preset} --load-format dummy --max-model-len 4096"


Q06, L8, A3B = _dummy("Qwen3-0.6B"), _dummy("Llama-3-8B"), _dummy("Qwen3-30B-A3B")
DSV2L, GPTOSS = _dummy("DeepSeek-V2-Lite"), _dummy("gpt-oss-20b")
SERVE_PORT = 8011
SERVE_L8 = (f"atomctl bench serve --backend atom --base-url http://127.0.0.1:{SERVE_PORT} --tokenizer preset:Llama-3-8B"
            " --dataset-name random --random-input-len 1024 --random-output-len 128 --ignore-eos")


def _latency(name: str, model: str, bs: int, extra: str = "", timeout_s: int = 120) -> Step:
    return Step(name, f"atomctl bench latency {model} --bs {bs} {extra} --output-json {{out}}/{name}.json".replace("  ", " "),
                timeout_s)


def _offline(name: str, model: str, extra: str = "", timeout_s: int = 180) -> Step:
    return Step(name, f"atomctl bench offline {model} {extra} --output-json {{out}}/{name}.json".replace("  ", " "),
                timeout_s)


def _profile(name: str, model: str, args: str) -> tuple[Step, Step]:
    traces = f"{{out}}/traces-{name}"
    return (Step(f"profile-{name}", f"atomctl profile {model} {args} --torch-profiler-dir {traces}", 180),
            Step(f"parse-trace-{name}",
                 f"atomctl parse-trace {{newest:{traces}/rank_0/[!c]*.json.gz}} --top 25 --out-dir {{out}}/{name}", 120))


SETS: dict[str, BenchSet] = {
    "gpu-tests": BenchSet("every test marked gpu (kernels against their references, engines on CUDA against HF)", (
        Step("gpu-tests", "python -m pytest -q --tb=short -m gpu -p no:cacheprovider tests", 600),
    )),
    "dense": BenchSet("the dense rows of docs/PERFORMANCE.md: nano-vllm's offline workload, batch-1 and batch-32 TPOT", (
        _offline("off-q06", Q06), _offline("off-l8", L8),
        _latency("lat-q06-bs1", Q06, 1), _latency("lat-q06-bs32", Q06, 32),
        _latency("lat-l8-bs1", L8, 1), _latency("lat-l8-bs32", L8, 32),
    )),
    "moe": BenchSet("MoE families: batch-1 / batch-32 TPOT and the offline workload", (
        _latency("lat-a3b-bs1", A3B, 1), _latency("lat-a3b-bs32", A3B, 32), _offline("off-a3b", A3B, timeout_s=240),
        _latency("lat-dsv2l-bs1", DSV2L, 1), _latency("lat-dsv2l-bs32", DSV2L, 32),
        _latency("lat-gptoss-bs1", GPTOSS, 1),
    )),
    "quant": BenchSet("quantized formats on Llama-3-8B and Qwen3-30B-A3B-FP8: TPOT and the offline workload", (
        _latency("lat-l8fp8-bs1", L8, 1, "--quantization fp8"), _latency("lat-l8fp8-bs32", L8, 32, "--quantization fp8"),
        _offline("off-l8fp8", L8, "--quantization fp8"),
        _latency("lat-a3bfp8-bs1", _dummy("Qwen3-30B-A3B-FP8"), 1),
        _latency("lat-l8w4-bs1", _dummy("Llama-3-8B-W4A16"), 1),
        _latency("lat-l8w8-bs1", _dummy("Llama-3-8B-W8A8"), 1), _latency("lat-l8w8-bs32", _dummy("Llama-3-8B-W8A8"), 32),
        _offline("off-q06-kv-fp8", Q06, "--kv-cache-dtype fp8"),
    )),
    "spec": BenchSet("speculative decoding: n-gram parity and TPOT on Llama-3-8B, MTP on DeepSeek-V2-Lite-MTP, "
                     "EAGLE-3 draft cost on Llama-3-8B", (
        Step("specdec-l8", "python -m benchmarks.engine.spec_decode_bench preset:Llama-3-8B --k 4 --out {out}/specdec_l8.json",
             300),
        _latency("lat-dsv2lm-bs1", _dummy("DeepSeek-V2-Lite-MTP"), 1, "--num-iters 2"),
        _latency("lat-dsv2lm-mtp1-bs1", _dummy("DeepSeek-V2-Lite-MTP"), 1, "--num-iters 2 --method mtp --num-speculative-tokens 1"),
        _latency("lat-dsv2lm-mtp3-bs1", _dummy("DeepSeek-V2-Lite-MTP"), 1, "--num-iters 2 --method mtp --num-speculative-tokens 3"),
        Step("eagle3-l8-k3", "python -m benchmarks.engine.eagle3_overhead preset:Llama-3-8B --k 3 --out {out}/eagle3_l8.json",
             300),
        Step("eagle3-l8-k3-graphs", "python -m benchmarks.engine.eagle3_overhead preset:Llama-3-8B --k 3 --mtp-graphs"
                                    " --profile 20 --out {out}/eagle3_l8_graphs.json", 300),
    )),
    "serve": BenchSet("online serving of Llama-3-8B at serve's defaults: c64 and c256, five requests a stream", (
        Step("serve-l8-c64", f"{SERVE_L8} --num-prompts 320 --max-concurrency 64 --seed 0"
                             " --save-result --result-dir {out} --result-filename serve_l8_c64.json", 180),
        # another seed: c64's prompts are still in the prefix cache
        Step("serve-l8-c256", f"{SERVE_L8} --num-prompts 1280 --max-concurrency 256 --seed 1"
                              " --save-result --result-dir {out} --result-filename serve_l8_c256.json", 300),
    ), server=f"atomctl serve {L8} --port {SERVE_PORT}"),
    "soak": BenchSet("the serving soak of Llama-3-8B at serve's defaults: 2,000 streams at concurrency 512, a fifth"
                     " of the clients hanging up mid-stream; checks whole answers, free KV blocks, flat memory", (
        Step("soak-l8-c512", "atomctl bench soak --base-url http://127.0.0.1:{port} --vocab-size 128000"
                             " --output-json {out}/soak_l8.json".replace("{port}", str(SERVE_PORT)), 540),
    ), server=f"atomctl serve {L8} --port {SERVE_PORT}"),
    "profile": BenchSet("where decode steps go: per-kernel breakdowns of batch-1 / batch-128 steps", (
        *_profile("l8-bs1", L8, "--bs 1 --input-length 512 --output-length 8"),
        *_profile("q06-bs128", Q06, "--mark-trace --bs 128 --input-length 900 --output-length 4"),
        *_profile("dsv2l-bs1", DSV2L, "--mark-trace --random-input --bs 1 --input-length 512 --output-length 6"),
    )),
    "multi-gpu": BenchSet("2 GPUs: TP/DP-EP GPU tests, all-reduce sizes, Llama-3-8B TP=2 TPOT, Qwen3-30B-A3B DP=2 + EP", (
        Step("tp-gpu-tests", "python -m pytest -q --tb=short -m gpu -p no:cacheprovider tests/distributed", 600),
        Step("allreduce", "python -m benchmarks.kernels.bench_allreduce --gpus 2", 180),
        _latency("lat-l8-tp2-bs1", L8, 1, "-tp 2"), _latency("lat-l8-tp2-bs32", L8, 32, "-tp 2"),
        _offline("off-a3b-dp2-ep", A3B, "-dp 2 --enable-expert-parallel", timeout_s=300),
    )),
    "kernels": BenchSet("kernel micro-benchmarks against torch and the bytes / FLOPs floor (no engine)", (
        Step("triton-vs-torch", "python -m benchmarks.kernels.bench_kernels", 180),
        Step("dense-gemv", "python -m benchmarks.kernels.dense_gemv_bench", 120),
        Step("fp8-gemm", "python -m benchmarks.kernels.fp8_bench --shapes llama-3-8b,deepseek-v3", 120),
        Step("fp8-moe", "python -m benchmarks.kernels.fp8_moe_bench", 120),
        Step("w4a16-moe", "python -m benchmarks.kernels.w4a16_moe_bench", 120),
        Step("moe-decode", "python -m benchmarks.kernels.moe_decode_bench", 120),
        Step("mxfp4-moe", "python -m benchmarks.kernels.mxfp4_bench", 120),
        Step("int4-int8-gemm", "python -m benchmarks.kernels.bench_int4 --out {out}/int4.json", 150),
        Step("prefill-attention", "python -m benchmarks.kernels.prefill_attention_bench --shapes llama-3-8b"
                                  " --tokens 2048,8192 --output-json {out}/prefill_attention.json", 150),
        Step("decode-attention-splits", "python -m benchmarks.kernels.sweep_attention", 120),
        Step("mla-decode", "python -m benchmarks.kernels.bench_mla --bs 64 --ctx 2048 --out {out}/mla.json", 60),
        Step("mla-prep", "python -m benchmarks.kernels.bench_mla_prep --out {out}/mla_prep.json", 60),
        Step("gated-deltanet", "python -m benchmarks.kernels.gdn_bench --out {out}/gdn.json", 120),
        Step("launch-overhead", "python -m benchmarks.kernels.bench_launch_overhead", 60),
    )),
    "host": BenchSet("host-side cost of engine steps: per-phase wall time offline, per-step host overhead", (
        Step("diag-steps-q06", "python -m benchmarks.engine.diag_steps preset:Qwen3-0.6B", 240),
        Step("host-overhead", "python -m benchmarks.engine.host_overhead atom_core/demo_model --runs 3", 120),
        Step("matrix-q06", "python -m benchmarks.engine.bench_matrix preset:Qwen3-0.6B --level 3 --steps 1,8"
                           " --latency-bs 1,32 --out {out}/matrix_q06.json", 240),
    )),
}
