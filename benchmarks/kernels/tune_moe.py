"""Tune fused_moe's tile configs on this GPU and write the table the kernel reads.

    python -m benchmarks.kernels.tune_moe --num-experts 128 --hidden 2048 --intermediate 768 \\
        --top-k 8 --dtype bfloat16 --batch-sizes 1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192
    python -m benchmarks.kernels.tune_moe --preset NAME   # sizes from atom_core/presets/NAME/config.json

Search, per batch size: for each BLOCK_M candidate, align once, then time GEMM1 over its tile
candidates and GEMM2 over its own (the GEMMs share only BLOCK_M, so they are tuned apart:
a sum of two searches instead of a product); keep the BLOCK_M with the least align + GEMM1 +
GEMM2 time. The winner is checked against the default config's output before it is kept.
Timing: CUDA events around each call after a write of FLUSH_BYTES, which evicts the weights
from L2 (as in a real layer, where they are not cached) and keeps the stream busy so launch
latency stays out of the numbers; warm-up, then the median of --reps. Multi-launch steps (the
alignment, the whole op) replay from a CUDA graph, as the engine's decode does, so their
host-side Python is not timed either.
The table is rewritten after every batch size; entries for other batch sizes are kept.
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
from triton.runtime.errors import OutOfResources

from atom_core.kernels.triton import moe as tm
from atom_core.kernels.triton.common import next_pow2
from atom_core.loader.model_dir import PRESET_DIR

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 2048, 4096, 8192)
FLUSH_BYTES = 256 << 20  # > the 50 MB L2 of an H100
SMEM_BYTES = 227 << 10  # H100 shared memory per block
MAX_ACC_ELEMENTS = 128 * 256  # fp32 accumulator elements per program before registers spill


@dataclass(frozen=True)
class MoeShape:
    num_experts: int
    hidden_size: int
    inter: int  # per-expert intermediate size (per rank, under tensor parallelism)
    top_k: int
    dtype: torch.dtype


def shape_from_hf_config(cfg: dict) -> MoeShape:
    """The routed-expert shape of a HF config.json (Qwen3-MoE, Mixtral, DeepSeek, GLM names)."""
    experts = next((cfg[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if cfg.get(k)), None)
    inter = cfg.get("moe_intermediate_size") or cfg.get("intermediate_size")
    if not experts or not inter or not cfg.get("num_experts_per_tok"):
        raise ValueError("config has no routed experts (need num_experts / num_local_experts / n_routed_experts, "
                         "num_experts_per_tok and an intermediate size)")
    dtype_name = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    if dtype_name not in DTYPES:
        raise ValueError(f"unknown dtype '{dtype_name}'; expected one of: {', '.join(DTYPES)}")
    return MoeShape(experts, cfg["hidden_size"], inter, cfg["num_experts_per_tok"], DTYPES[dtype_name])


def write_config_table(path: Path, configs: dict[int, tm.MoeConfig], meta: dict) -> None:
    """The file `moe.load_config_table` reads, one batch size a line so diffs stay readable."""
    lines = [f'  "{m}": {json.dumps(asdict(c))}' for m, c in sorted(configs.items())]
    path.write_text(f'{{"meta": {json.dumps(meta)},\n "configs": {{\n' + ",\n".join(lines) + "\n }\n}\n")


def block_m_candidates(num_tokens: int, top_k: int, num_experts: int) -> list[int]:
    """Tiles taller than ~4x the average rows per expert are mostly padding."""
    rows_per_expert = num_tokens * top_k / num_experts
    return [m for m in (16, 32, 64, 128) if m == 16 or m <= 4 * rows_per_expert]


def tile_candidates(block_m: int, rows_per_expert: float, n: int, k: int, dtype: torch.dtype,
                    gemm1: bool) -> list[tm.GemmTile]:
    """GEMM tiles worth timing; n, k are the GEMM's dims (GEMM1: I and H; GEMM2: H and I)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    b_tiles = 2 if gemm1 else 1  # GEMM1 loads a gate and an up tile per step
    tiles = []
    for bn, bk, warps, stages in itertools.product((32, 64, 128, 256), (32, 64, 128, 256), (4, 8), (2, 3, 4, 5)):
        if bn > max(32, next_pow2(n)) or bk > max(32, next_pow2(k)):
            continue
        if block_m * bn * b_tiles > MAX_ACC_ELEMENTS or stages * (block_m * bk + b_tiles * bk * bn) * elem > SMEM_BYTES:
            continue
        if (bk == 256 and block_m > 32) or (bk == 32 and block_m < 64):  # long K tiles only pay when M is small
            continue
        if warps == 8 and block_m * bn < 64 * 128:
            continue
        for group_m in ((1, 16) if rows_per_expert > block_m else (1,)):
            tiles.append(tm.GemmTile(bn, bk, group_m, warps, stages))
    return tiles


def time_ms(fn, reps: int, flush: torch.Tensor, budget_ms: float = 100.0) -> float:
    """Median device time of fn() in ms (see the module docstring); slow candidates get fewer
    repetitions (at least 3), so a bad tile for a big batch costs about budget_ms."""
    def timed(n: int) -> list[float]:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for start, end in events:
            flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in events]

    fn()
    first = timed(1)[0]
    return statistics.median(timed(max(3, min(reps, int(budget_ms / max(first, 1e-3))))))


@dataclass
class Problem:
    """Random inputs for one batch size; weights are shared across batch sizes."""
    hidden: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor


def make_weights(shape: MoeShape, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    e, h, i = shape.num_experts, shape.hidden_size, shape.inter
    w13 = torch.randn(e, 2 * i, h, device=device, dtype=shape.dtype, generator=gen) * h ** -0.5
    w2 = torch.randn(e, h, i, device=device, dtype=shape.dtype, generator=gen) * i ** -0.5
    return w13, w2


def make_problem(shape: MoeShape, num_tokens: int, w13: torch.Tensor, w2: torch.Tensor) -> Problem:
    device = w13.device
    gen = torch.Generator(device=device).manual_seed(num_tokens)
    hidden = torch.randn(num_tokens, shape.hidden_size, device=device, dtype=shape.dtype, generator=gen)
    logits = torch.randn(num_tokens, shape.num_experts, device=device, generator=gen)
    weights, ids = tm.moe_route(logits, shape.top_k, renormalize=True)
    return Problem(hidden, w13, w2, weights, ids)


def _best_tile(run, tiles: list[tm.GemmTile], reps: int, flush: torch.Tensor) -> tuple[tm.GemmTile, float]:
    """Compile every tile in parallel (the compiler mostly runs outside the GIL), then time each."""
    def compile_one(tile):
        try:
            run(tile)
            return tile
        except OutOfResources:
            return None

    with ThreadPoolExecutor(8) as pool:
        ok = [t for t in pool.map(compile_one, tiles) if t is not None]
    torch.cuda.synchronize()
    timed = [(time_ms(lambda: run(t), reps, flush), t) for t in ok]
    ms, tile = min(timed, key=lambda x: x[0])
    return tile, ms


def tune_batch(shape: MoeShape, prob: Problem, reps: int,
               flush: torch.Tensor) -> tuple[tm.MoeConfig, tuple[float, float, float]]:
    """The best MoeConfig for this problem and its (align, GEMM1, GEMM2) times in ms."""
    num_tokens = prob.hidden.shape[0]
    rows_per_expert = num_tokens * shape.top_k / shape.num_experts
    best = None
    for block_m in block_m_candidates(num_tokens, shape.top_k, shape.num_experts):
        align = lambda: tm.moe_align_block_size(prob.topk_ids, block_m, shape.num_experts)  # noqa: E731
        align_ms = graph_ms(align, reps, flush)
        sorted_ids, expert_ids, num_post = align()
        act = prob.hidden.new_empty((sorted_ids.shape[0], shape.inter))
        partial = prob.hidden.new_empty((num_tokens * shape.top_k, shape.hidden_size))
        tiles1 = tile_candidates(block_m, rows_per_expert, shape.inter, shape.hidden_size, shape.dtype, True)
        tile1, ms1 = _best_tile(lambda t: tm.moe_gemm1(prob.hidden, prob.w13, None, sorted_ids, expert_ids, num_post,
                                                       shape.top_k, block_m, t, act), tiles1, reps, flush)
        tiles2 = tile_candidates(block_m, rows_per_expert, shape.hidden_size, shape.inter, shape.dtype, False)
        tile2, ms2 = _best_tile(lambda t: tm.moe_gemm2(act, prob.w2, None, prob.topk_weights, sorted_ids, expert_ids,
                                                       num_post, block_m, t, partial), tiles2, reps, flush)
        if best is None or align_ms + ms1 + ms2 < sum(best[1]):
            best = (tm.MoeConfig(block_m, tile1, tile2), (align_ms, ms1, ms2))
    return best


def graph_ms(fn, reps: int, flush: torch.Tensor) -> float:
    """time_ms of fn captured in a CUDA graph: a few eager launches would time the host, not
    the GPU, at small batches."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_ms(graph.replay, reps, flush)


def fused_ms(prob: Problem, config: tm.MoeConfig, reps: int, flush: torch.Tensor) -> float:
    return graph_ms(lambda: tm.launch_fused_moe(prob.hidden, prob.w13, prob.w2, prob.topk_weights, prob.topk_ids,
                                                config=config), reps, flush)


def check_config(prob: Problem, config: tm.MoeConfig, baseline: tm.MoeConfig) -> None:
    args = (prob.hidden, prob.w13, prob.w2, prob.topk_weights, prob.topk_ids)
    out, ref = tm.launch_fused_moe(*args, config=config).float(), tm.launch_fused_moe(*args, config=baseline).float()
    err = ((out - ref).norm() / ref.norm()).item()
    assert err < 1e-2, f"config {config} disagrees with the default config: rel err {err:.2e}"


def parse_args(argv: list[str] | None) -> tuple[MoeShape, list[int], Path, int]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels.tune_moe", description=__doc__.split("\n")[0])
    p.add_argument("--preset", help="read the sizes from atom_core/presets/NAME/config.json")
    p.add_argument("--num-experts", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--intermediate", type=int, help="per-expert intermediate size (per rank under TP)")
    p.add_argument("--top-k", type=int)
    p.add_argument("--dtype", choices=sorted(DTYPES))
    p.add_argument("--batch-sizes", default=",".join(map(str, DEFAULT_BATCH_SIZES)))
    p.add_argument("--out", type=Path, default=tm.CONFIG_DIR, help="folder for the JSON table")
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args(argv)
    if a.preset:
        path = PRESET_DIR / a.preset / "config.json"
        if not path.is_file():
            raise ValueError(f"no preset '{a.preset}': {path} does not exist")
        s = shape_from_hf_config(json.loads(path.read_text()))
        shape = MoeShape(a.num_experts or s.num_experts, a.hidden or s.hidden_size, a.intermediate or s.inter,
                         a.top_k or s.top_k, DTYPES[a.dtype] if a.dtype else s.dtype)
    else:
        missing = [n for n in ("num_experts", "hidden", "intermediate", "top_k") if getattr(a, n) is None]
        if missing:
            p.error(f"without --preset, give --{', --'.join(m.replace('_', '-') for m in missing)}")
        shape = MoeShape(a.num_experts, a.hidden, a.intermediate, a.top_k, DTYPES[a.dtype or "bfloat16"])
    batch_sizes = sorted({int(b) for b in a.batch_sizes.split(",") if b.strip()})
    if not batch_sizes or batch_sizes[0] < 1:
        p.error(f"--batch-sizes must be positive integers, got '{a.batch_sizes}'")
    return shape, batch_sizes, a.out, a.reps


def main(argv: list[str] | None = None) -> int:
    shape, batch_sizes, out_dir, reps = parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_moe needs a CUDA GPU", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    path = out_dir / tm.config_file_name(shape.num_experts, shape.hidden_size, shape.inter, shape.dtype,
                                         tm.device_name(device))
    existing = tm.load_config_table(path) if path.is_file() else None
    configs = dict(existing[0]) if existing and existing[1] == shape.top_k else {}
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
    w13, w2 = make_weights(shape, "cuda")
    meta = {"top_k": shape.top_k, "triton": triton.__version__, "torch": torch.__version__,
            "device": torch.cuda.get_device_name(device), "reps": reps}
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"{shape}  ->  {path}")
    print(f"{'tokens':>7} {'align':>7} {'gemm1':>7} {'gemm2':>7} {'tuned':>7} {'default':>7} {'speedup':>7} "
          f"{'secs':>5}  config (times in ms; tuned/default: the whole op from a CUDA graph)")
    for num_tokens in batch_sizes:
        started = time.perf_counter()
        prob = make_problem(shape, num_tokens, w13, w2)
        config, parts = tune_batch(shape, prob, reps, flush)
        default = tm.default_moe_config(num_tokens, shape.top_k, shape.num_experts, shape.dtype)
        check_config(prob, config, default)
        tuned, base = fused_ms(prob, config, reps, flush), fused_ms(prob, default, reps, flush)
        configs[num_tokens] = config
        write_config_table(path, configs, meta)  # after every batch size: an interrupted run keeps its results
        print(f"{num_tokens:>7} {parts[0]:>7.4f} {parts[1]:>7.4f} {parts[2]:>7.4f} {tuned:>7.4f} {base:>7.4f} "
              f"{base / tuned:>7.2f} {time.perf_counter() - started:>5.0f}  {config}", flush=True)
    tm.load_config_table.cache_clear()
    print(f"wrote {path} ({len(configs)} batch sizes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
