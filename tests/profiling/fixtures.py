"""Builds small synthetic Chrome traces shaped like atom_core's GPU traces, for parser tests.

`build_trace()`: one CPU thread (pid 100, tid 1) and one GPU stream (pid 0, tid 7):
  - a warm-up kernel launched before any step (must be ignored),
  - `atom_step[prefill] bs=2 tokens=16`: eager, every module in a range, one
    `cudaLaunchKernel`/`cuLaunchKernel` per kernel, correlated to its GPU kernel;
  - `atom_step[decode] bs=2 tokens=2`: the same, eager;
  - two `atom_step[decode] bs=2 tokens=2 graph_bs=2` steps: one `cudaGraphLaunch` whose
    correlation id all the model's kernels carry, then the sampler launched eagerly.
GPU kernels start LAG_US after their launch, long after the launching module's range ended,
so only correlation ids attribute them right. Correlation ids are shuffled and the event list
is shuffled, so neither id order nor file order carry the answer.

`build_capture_trace(bs)`: what `TorchProfiler.record_graph_capture` records: a
`atom_graph_capture bs=N` range holding an eager warm-up forward (real kernels), then between
cudaStreamBeginCapture / cudaStreamEndCapture the captured forward: module ranges and launch
calls only, plus capture bookkeeping calls that are not launches.

Durations come from `kernel_duration`, multiples of 1/4 so that means are exact.
Regenerate the checked-in files with: python tests/profiling/fixtures.py
"""
from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"
FIXTURE_TRACE = DATA_DIR / "fixture_trace.json.gz"
FIXTURE_CAPTURE = DATA_DIR / "capture_bs2_fixture.pt.trace.json.gz"

NUM_LAYERS = 4
CPU = {"pid": 100, "tid": 1}
GPU = {"pid": 0, "tid": 7}
LAG_US = 40.0
LAUNCH_US = 4.0

# A node is (module name, children); a child is a kernel name (launched by that module) or a node.
LAYER_TREE = [
    ("input_layernorm", ["rms_norm_kernel"]),
    (
        "self_attn",
        [
            ("qkv_proj", ["nvjet_sm90_gemm_qkv"]),
            ("rotary_emb", ["rotary_embedding_kernel"]),
            ("attn", ["reshape_and_cache_kernel", "paged_attention_kernel"]),
            ("o_proj", ["nvjet_sm90_gemm_o_proj"]),
        ],
    ),
    ("post_attention_layernorm", ["fused_add_rms_norm_kernel"]),
    (
        "mlp",
        [
            ("gate_up_proj", ["nvjet_sm90_gemm_gate_up"]),
            ("act_fn", ["silu_and_mul_kernel"]),
            ("down_proj", ["nvjet_sm90_gemm_down"]),
        ],
    ),
]
BASE_US = {
    "embedding_kernel": 2.0,
    "rms_norm_kernel": 3.0,
    "nvjet_sm90_gemm_qkv": 10.0,
    "rotary_embedding_kernel": 2.0,
    "reshape_and_cache_kernel": 1.5,
    "paged_attention_kernel": 8.0,
    "nvjet_sm90_gemm_o_proj": 6.0,
    "fused_add_rms_norm_kernel": 3.5,
    "nvjet_sm90_gemm_gate_up": 20.0,
    "silu_and_mul_kernel": 4.0,
    "nvjet_sm90_gemm_down": 12.0,
    "nvjet_sm90_gemm_lm_head": 30.0,
    "argmax_sampler_kernel": 2.5,
}
SAMPLER_KERNEL = "argmax_sampler_kernel"


def model_tree(num_layers: int = NUM_LAYERS) -> list:
    layers = [(f"layers.{i}", LAYER_TREE) for i in range(num_layers)]
    return [("embed_tokens", ["embedding_kernel"]), *layers, ("norm", ["rms_norm_kernel"]), ("lm_head", ["nvjet_sm90_gemm_lm_head"])]


def model_kernels(num_layers: int = NUM_LAYERS) -> list[tuple[str, str]]:
    """(module, kernel) of every kernel of one forward, in launch order."""
    out: list[tuple[str, str]] = []

    def walk(prefix: str, children: list) -> None:
        for child in children:
            if isinstance(child, str):
                out.append((prefix, child))
            else:
                walk(f"{prefix}.{child[0]}" if prefix else child[0], child[1])

    walk("", model_tree(num_layers))
    return out


def kernel_duration(phase: str, module: str, kernel: str, decode_step: int = 0) -> float:
    """Prefill: 4x the base; +0.5 us per layer index; decode step k adds k/4 us."""
    layer = int(module.split(".")[1]) if module.startswith("layers.") else 0
    base = BASE_US[kernel] * (4 if phase == "prefill" else 1)
    return base + 0.5 * layer + (0.25 * decode_step if phase == "decode" else 0.0)


class _TraceWriter:
    def __init__(self, seed: int):
        self.events: list[dict] = []
        self.t = 1_000_000.0
        self.gpu_t = self.t
        self.rng = random.Random(seed)
        self.corr_pool = list(range(1000, 1000 + 4000))
        self.rng.shuffle(self.corr_pool)

    def cpu(self, cat: str, name: str, ts: float, dur: float, **args) -> None:
        self.events.append({"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, **CPU, "args": args})

    def launch(self, name: str = "cudaLaunchKernel") -> int:
        corr = self.corr_pool.pop()
        self.cpu("cuda_runtime" if name.startswith("cuda") else "cuda_driver", name, self.t, LAUNCH_US, correlation=corr)
        self.t += LAUNCH_US + 1.0
        return corr

    def kernel(self, name: str, corr: int, dur: float, launch_ts: float) -> None:
        start = max(self.gpu_t, launch_ts + LAG_US)
        self.events.append(
            {"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": dur, **GPU, "args": {"correlation": corr, "stream": 7}}
        )
        self.gpu_t = start + dur + 0.5

    def module_forward(self, phase: str, decode_step: int, with_kernels: bool, children: list, prefix: str = "") -> None:
        """Ranges and launches of a forward; kernels too unless capturing."""
        for child in children:
            if isinstance(child, str):
                launch_ts = self.t
                corr = self.launch("cuLaunchKernel" if child.startswith("nvjet") else "cudaLaunchKernel")
                if with_kernels:
                    self.kernel(child, corr, kernel_duration(phase, prefix, child, decode_step), launch_ts)
                continue
            name = f"{prefix}.{child[0]}" if prefix else child[0]
            start = self.t
            self.t += 1.0
            self.module_forward(phase, decode_step, with_kernels, child[1], name)
            self.t += 1.0
            self.cpu("user_annotation", name, start, self.t - start)
            self.t += 0.5

    def eager_step(self, name: str, phase: str, decode_step: int, num_layers: int) -> None:
        start = self.t
        self.t += 2.0
        self.module_forward(phase, decode_step, True, model_tree(num_layers))
        self.sampler(phase, decode_step)
        self.cpu("user_annotation", name, start, self.t - start)
        self.t = max(self.t, self.gpu_t) + 5.0

    def graph_step(self, name: str, decode_step: int, num_layers: int) -> None:
        start = self.t
        self.t += 2.0
        launch_ts = self.t
        corr = self.corr_pool.pop()
        self.cpu("cuda_runtime", "cudaGraphLaunch", launch_ts, 10.0, correlation=corr)
        self.t += 11.0
        for module, kernel in model_kernels(num_layers):
            self.kernel(kernel, corr, kernel_duration("decode", module, kernel, decode_step), launch_ts)
        self.sampler("decode", decode_step)
        self.cpu("user_annotation", name, start, self.t - start)
        self.t = max(self.t, self.gpu_t) + 5.0

    def sampler(self, phase: str, decode_step: int) -> None:
        launch_ts = self.t
        corr = self.launch()
        self.kernel(SAMPLER_KERNEL, corr, kernel_duration(phase, "", SAMPLER_KERNEL, decode_step), launch_ts)

    def finish(self) -> dict:
        self.rng.shuffle(self.events)
        meta = [
            {"ph": "M", "name": "process_name", "pid": CPU["pid"], "tid": 0, "args": {"name": "python"}},
            {"ph": "M", "name": "thread_name", "pid": GPU["pid"], "tid": GPU["tid"], "args": {"name": "stream 7"}},
        ]
        return {"schemaVersion": 1, "displayTimeUnit": "ms", "traceEvents": meta + self.events}


def build_trace(num_layers: int = NUM_LAYERS) -> dict:
    """The main fixture trace (see module doc)."""
    w = _TraceWriter(seed=0)
    warmup_ts = w.t
    w.kernel("warmup_kernel", w.launch(), 50.0, warmup_ts)
    w.t = w.gpu_t + 10.0
    w.eager_step("atom_step[prefill] bs=2 tokens=16", "prefill", 0, num_layers)
    w.eager_step("atom_step[decode] bs=2 tokens=2", "decode", 0, num_layers)
    w.graph_step("atom_step[decode] bs=2 tokens=2 graph_bs=2", 1, num_layers)
    w.graph_step("atom_step[decode] bs=2 tokens=2 graph_bs=2", 2, num_layers)
    # The GPU-side copy of a range: same name, GPU thread; must not count as a module range.
    w.events.append({"ph": "X", "cat": "gpu_user_annotation", "name": "layers.0.mlp", "ts": w.t, "dur": 5.0, **GPU, "args": {}})
    return w.finish()


def build_capture_trace(batch_size: int = 2, num_layers: int = NUM_LAYERS) -> dict:
    """A capture trace for one batch size (see module doc)."""
    w = _TraceWriter(seed=batch_size)
    start = w.t
    w.t += 1.0
    w.module_forward("decode", 0, True, model_tree(num_layers))  # warm-up run before capture
    w.t = max(w.t, w.gpu_t) + 2.0
    w.cpu("cuda_runtime", "cudaStreamBeginCapture", w.t, 2.0, correlation=w.corr_pool.pop())
    w.t += 3.0
    w.cpu("cuda_runtime", "cudaStreamIsCapturing", w.t, 1.0, correlation=w.corr_pool.pop())
    w.t += 2.0
    w.module_forward("decode", 0, False, model_tree(num_layers))
    w.cpu("cuda_runtime", "INVALID", w.t, 1.0, correlation=w.corr_pool.pop())
    w.t += 2.0
    w.cpu("cuda_runtime", "cudaStreamEndCapture", w.t, 2.0, correlation=w.corr_pool.pop())
    w.t += 3.0
    w.cpu("cuda_runtime", "cudaGraphInstantiateWithFlags", w.t, 20.0, correlation=w.corr_pool.pop())
    w.t += 21.0
    w.cpu("user_annotation", f"atom_graph_capture bs={batch_size}", start, w.t - start)
    return w.finish()


def write_trace(data: dict, path: Path) -> Path:
    """Write a trace as .json or (deterministic bytes) .json.gz."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, separators=(",", ":")).encode()
    if path.name.endswith(".gz"):
        with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as f:
            f.write(text)
    else:
        path.write_bytes(text)
    return path


def write_fixture_files(directory: Path = DATA_DIR) -> list[Path]:
    return [
        write_trace(build_trace(), directory / FIXTURE_TRACE.name),
        write_trace(build_capture_trace(2), directory / FIXTURE_CAPTURE.name),
    ]


if __name__ == "__main__":
    for written in write_fixture_files():
        print(written)
