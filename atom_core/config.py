"""Engine configuration in parts, each frozen and validated on construction.

`EngineConfig.from_kwargs(model, **options)` takes the flat option names the CLI and
`LLMEngine(...)` use (every name is also an `atomctl` flag) and sorts them into parts; each
component takes its own part. What depends on the checkpoint (the HF config, the resolved
dtype, max_model_len, EOS ids) is resolved once, by `loader.resolve_model`, into a
`ResolvedModel` that the engine core hands to the scheduler and the worker.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch

from atom_core.envs import read_envs
from atom_core.kernel_config import KERNEL_OPTIONS, KernelConfig
from atom_core.lora import LoRAModule, parse_lora_modules

DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8) + tuple(range(16, 513, 16))
CudaGraphMode = Literal["full_decode_only", "piecewise", "full_and_piecewise"]
CUDAGRAPH_MODES: tuple[str, ...] = get_args(CudaGraphMode)
# The graphs an engine captures when the options name no mode: a lone prompt's prefill replays
# piecewise graphs instead of launching every layer's kernels from Python (time to first token),
# decode-only batches the full graphs. CPU, eager, level 0 / 2 and replicas sharing experts keep
# full_decode_only (they capture no piecewise graphs).
DEFAULT_GRAPH_MODE = "full_and_piecewise"
# Piecewise graphs' token buckets (the ladder vLLM uses): fine steps where padding costs most.
DEFAULT_PIECEWISE_SIZES = (1, 2, 4) + tuple(range(8, 256, 8)) + tuple(range(256, 513, 16))


def _fail(part, name: str, why: str) -> None:
    flag = "--" + name.replace("_", "-")
    raise ValueError(f"invalid engine option {name}={getattr(part, name)!r} ({flag}): {why}")


def _check_prompt_cap(part, cap: str, min_tokens: str, default_min: int, why_chunked: str) -> None:
    """The rules both caps on the prompt tokens beside decodes (prefill pacing, the mixed-step cap)
    share: the cap is >= 0 (0 = off) and needs chunked prefill; its minimum is >= 1 and may be
    changed only with the cap on, so a minimum is never accepted and then ignored."""
    if getattr(part, cap) < 0:
        _fail(part, cap, "must be >= 0 (0 = off)")
    if getattr(part, min_tokens) < 1:
        _fail(part, min_tokens, "must be >= 1")
    if getattr(part, cap) and not part.enable_chunked_prefill:
        _fail(part, cap, f"needs chunked prefill ({why_chunked})")
    if not getattr(part, cap) and getattr(part, min_tokens) != default_min:
        _fail(part, min_tokens, f"applies only with {cap}: set it too")


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint, in which dtype, on which device. `model` is a local HF directory or
    `preset:NAME`; load_format dummy draws random weights (benchmarks)."""

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    load_format: Literal["auto", "dummy"] = "auto"
    quantization: str | None = None  # --quantization: must match the checkpoint's; fp8 also quantizes a bf16 one online

    def __post_init__(self) -> None:
        if not self.model:
            _fail(self, "model", "a model directory or preset:NAME is required")
        if self.dtype not in DTYPES and self.dtype not in DTYPE_ALIASES:
            _fail(self, "dtype", f"expected one of: {', '.join([*DTYPES, *DTYPE_ALIASES])}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            _fail(self, "device", "expected auto, cpu, cuda or cuda:N")
        if self.max_model_len is not None and self.max_model_len < 1:
            _fail(self, "max_model_len", "must be >= 1")
        if self.load_format not in ("auto", "dummy"):
            _fail(self, "load_format", "expected auto or dummy")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_dtype(self, config_dtype: torch.dtype | None) -> torch.dtype:
        """auto: the checkpoint's bf16/fp16 on a GPU (bf16 if it says fp32); float32 on the CPU."""
        name = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if name != "auto":
            return DTYPES[name]
        if self.torch_device.type == "cpu":
            return torch.float32
        if config_dtype in (torch.float16, torch.bfloat16):
            return config_dtype
        return torch.bfloat16

    def resolve_max_model_len(self, hf_config) -> int:
        limit = getattr(hf_config, "max_position_embeddings", None)
        if self.max_model_len is None:
            if limit is None:
                raise ValueError("config.json has no max_position_embeddings; pass max_model_len")
            return limit
        if limit is not None and self.max_model_len > limit:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings={limit}")
        return self.max_model_len


@dataclass(frozen=True)
class ResolvedModel:
    """The model part after reading the checkpoint's config (built by `loader.resolve_model` at engine
    start: config/ sits below the model registry and quant/, so it does not build this itself)."""

    hf_config: object
    path: object  # pathlib.Path of the model directory
    architecture: str
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    eos_token_ids: frozenset[int]
    vocab_size: int
    quant_config: object  # atom_core.quant.QuantConfig from the checkpoint's quantization_config; None: unquantized
    seed: int
    load_format: str


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache. num_kv_blocks, when set, fixes its size; otherwise it is sized from
    gpu_memory_utilization on a GPU, or from kv_cache_memory_gb on the CPU."""

    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_gb: float = 1.0
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES: auto = the model's; fp8 halves the bytes per token
    # (fp8_per_token_head: plus a float32 scale per token and KV head, see KVCacheFormat)
    index_cache_dtype: str = "auto"  # INDEX_CACHE_DTYPES: sparse-attention indexer keys (kv_spec.set_index_cache_dtype)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            _fail(self, "block_size", "must be a power of two")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            _fail(self, "kv_cache_dtype", f"must be one of: {', '.join(KV_CACHE_DTYPES)}")
        if self.index_cache_dtype not in INDEX_CACHE_DTYPES:
            _fail(self, "index_cache_dtype", f"must be one of: {', '.join(INDEX_CACHE_DTYPES)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            _fail(self, "num_kv_blocks", "must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            _fail(self, "gpu_memory_utilization", "must be in (0, 1]")
        if not self.kv_cache_memory_gb > 0:
            _fail(self, "kv_cache_memory_gb", "must be > 0")


INDEX_CACHE_DTYPES = ("auto", "fp8")
KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "fp16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2",
                   "fp8_per_token_head")


@dataclass(frozen=True)
class KVCacheFormat:
    """What --kv-cache-dtype resolves to. per_token_head_scales (fp8_per_token_head, vLLM's name
    for it; ATOM's `fp8` on AITER): each stored token's K and V of one KV head carry their own
    float32 scale (amax / FP8 max), written beside the codes at store time, instead of one
    per-layer scale."""

    dtype: torch.dtype
    per_token_head_scales: bool = False


def kv_cache_format(name: str, model_dtype: torch.dtype) -> KVCacheFormat:
    """The KV cache format for --kv-cache-dtype NAME: auto keeps the model dtype; a 16-bit
    name must be the model dtype (attention reads K/V as the query's type); fp8 is e4m3."""
    fp8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
    if name == "auto":
        return KVCacheFormat(model_dtype)
    if name == "fp8_per_token_head":
        return KVCacheFormat(torch.float8_e4m3fn, per_token_head_scales=True)
    if name in fp8:
        return KVCacheFormat(fp8[name])
    wanted = torch.bfloat16 if name in ("bf16", "bfloat16") else torch.float16
    if wanted != model_dtype:
        raise ValueError(f"--kv-cache-dtype {name} differs from the model dtype {model_dtype}; use auto, "
                         f"fp8, fp8_e5m2 or fp8_per_token_head, or --dtype {str(wanted).removeprefix('torch.')}")
    return KVCacheFormat(wanted)



PREFILL_PACING_MIN_TOKENS = 512
MIXED_STEP_MIN_TOKENS = 256
PREFILL_HOLD_MAX_STEPS = 16


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching. num_scheduler_steps > 1: decode windows of that many steps while
    no request waits (one host round trip per window).

    prefill_pacing_steps K > 0: while sequences decode, a step's prompt tokens are capped at
    max(prefill_pacing_min_tokens, outstanding prompt tokens / K). A burst of prompts (a closed-
    loop client's whole wave) is then spread over about K decode steps instead of being admitted
    in a few full-budget steps that stall every decode and end in lock-step; later steps carry
    their share of prompt tokens while the decodes ride along. 0 = off (the full budget).

    mixed_step_tokens_per_seq R > 0: while sequences decode, a step carries at most R tokens per
    live request (running or waiting), at least mixed_step_min_tokens and at most the budget, to the
    nearest multiple of 128 (scheduler.MIXED_STEP_GRANULE): the decodes, then prompt chunks in what is left.
    A loaded server then runs steps of a few hundred tokens whose decodes ride along compute-bound
    prompt chunks, instead of full-budget prompt steps that stall every decode (TPOT) and end the
    streams in lock-step; the cap grows with the load (256 streams get 4x the step of 64). Steps with
    nothing decoding take the whole budget. Exclusive with pacing. 0 = off.

    prefill_hold_fraction F > 0: while sequences decode, prompts wait until at least F of the live
    requests are starting (waiting, or part-way through their prompt), until no request has joined the
    queue for two steps (scheduler.HOLD_QUIET_STEPS), or until the oldest has waited
    prefill_hold_max_steps schedule calls; then prompts take the whole budget beside the decodes until
    none is starting. A closed-loop load then prefills its returning requests in waves of full-budget
    steps while few streams decode, instead of stalling nearly every stream for each prompt that
    comes back: time per output token falls and the time to first token rises by the wait; a lone
    request under light load waits the two quiet steps. Exclusive with pacing and the mixed-step cap.
    0 = off."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    async_scheduling: bool = True
    num_scheduler_steps: int = 8
    prefill_pacing_steps: int = 0
    prefill_pacing_min_tokens: int = PREFILL_PACING_MIN_TOKENS
    mixed_step_tokens_per_seq: int = 0
    mixed_step_min_tokens: int = MIXED_STEP_MIN_TOKENS
    prefill_hold_fraction: float = 0.0
    prefill_hold_max_steps: int = PREFILL_HOLD_MAX_STEPS

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            _fail(self, "max_num_seqs", "must be >= 1")
        if self.max_num_batched_tokens < 1:
            _fail(self, "max_num_batched_tokens", "must be >= 1")
        if not 1 <= self.num_scheduler_steps <= 64:
            _fail(self, "num_scheduler_steps", "must be between 1 and 64")
        _check_prompt_cap(self, "prefill_pacing_steps", "prefill_pacing_min_tokens", PREFILL_PACING_MIN_TOKENS,
                          "a paced prompt is admitted a chunk at a time")
        _check_prompt_cap(self, "mixed_step_tokens_per_seq", "mixed_step_min_tokens", MIXED_STEP_MIN_TOKENS,
                          "a prompt shares a capped step a chunk at a time")
        if self.mixed_step_tokens_per_seq and self.prefill_pacing_steps:
            _fail(self, "mixed_step_tokens_per_seq", "cannot be combined with prefill_pacing_steps "
                  "(--prefill-pacing-steps): both cap the prompt tokens beside decodes; choose one")
        self._check_prefill_hold()

    def _check_prefill_hold(self) -> None:
        if not 0 <= self.prefill_hold_fraction <= 1:
            _fail(self, "prefill_hold_fraction", "must be between 0 (off) and 1")
        if self.prefill_hold_max_steps < 1:
            _fail(self, "prefill_hold_max_steps", "must be >= 1")
        if not self.prefill_hold_fraction and self.prefill_hold_max_steps != PREFILL_HOLD_MAX_STEPS:
            _fail(self, "prefill_hold_max_steps", "applies only with prefill_hold_fraction: set it too")
        for other in ("prefill_pacing_steps", "mixed_step_tokens_per_seq"):
            if self.prefill_hold_fraction and getattr(self, other):
                _fail(self, "prefill_hold_fraction", f"cannot be combined with {other} "
                      f"(--{other.replace('_', '-')}): both decide the prompt tokens beside decodes; choose one")


@dataclass(frozen=True)
class CompileConfig:
    """level: 0 eager; 1 CUDA graphs for decode; 2 torch.compile of the decoder layers (graph
    split at attention); 3 (default) compile + CUDA graphs. enforce_eager forces level 0.
    Only GPUs compile or capture; the CPU always runs eagerly.

    cudagraph_mode (vLLM's names), at levels 1 and 3: full_decode_only captures whole
    decode-only batches (cudagraph_capture_sizes, in requests); piecewise captures every step of
    up to max(piecewise_capture_sizes) tokens split at attention, which runs eagerly between the
    graphs (worker/piecewise.py); full_and_piecewise does both, decode-only batches taking the
    full graphs (EngineConfig.from_kwargs's default where graphs are captured: DEFAULT_GRAPH_MODE;
    the field's own default is what an engine without graphs keeps). piecewise_capture_sizes: token buckets (default: a ladder up to 512, capped at
    max_num_batched_tokens); a step over the largest runs eagerly."""

    level: int = 3
    enforce_eager: bool = False
    cudagraph_capture_sizes: tuple[int, ...] = DEFAULT_CAPTURE_SIZES
    cudagraph_mode: CudaGraphMode = "full_decode_only"
    piecewise_capture_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.level not in (0, 1, 2, 3):
            _fail(self, "level", "expected 0, 1, 2 or 3")
        if not self.cudagraph_capture_sizes or any(s < 1 for s in self.cudagraph_capture_sizes):
            _fail(self, "cudagraph_capture_sizes", "must be a non-empty list of positive batch sizes")
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            _fail(self, "cudagraph_mode", f"expected one of: {', '.join(CUDAGRAPH_MODES)}")
        if self.cudagraph_mode != "full_decode_only" and (self.enforce_eager or self.level in (0, 2)):
            _fail(self, "cudagraph_mode", "needs CUDA graphs: --level 1 or 3, without --enforce-eager")
        if self.piecewise_capture_sizes is not None:
            if not self.piecewise_capture_sizes or any(s < 1 for s in self.piecewise_capture_sizes):
                _fail(self, "piecewise_capture_sizes", "must be a non-empty list of positive token counts")
            if self.cudagraph_mode == "full_decode_only":
                _fail(self, "piecewise_capture_sizes", "only used with --cudagraph-mode piecewise or "
                      "full_and_piecewise")

    def piecewise_sizes(self, max_num_batched_tokens: int) -> tuple[int, ...]:
        """Token buckets of the piecewise graphs, none larger than a step can be; a budget between
        two default rungs is a bucket itself (a full step then replays without padding)."""
        sizes = set(self.piecewise_capture_sizes or DEFAULT_PIECEWISE_SIZES)
        capped = {s for s in sizes if s <= max_num_batched_tokens}
        if self.piecewise_capture_sizes is None and max_num_batched_tokens < max(sizes):
            capped.add(max_num_batched_tokens)
        return tuple(sorted(capped)) or (max_num_batched_tokens,)

    def use_cuda_graphs(self, device: torch.device) -> bool:
        return device.type == "cuda" and not self.enforce_eager and self.level in (1, 3)

    def use_compile(self, device: torch.device, mark_trace: bool = False) -> bool:
        # mark_trace wraps modules in record_function ranges, which compiled graphs drop.
        return device.type == "cuda" and not self.enforce_eager and self.level in (2, 3) and not mark_trace

    def capture_sizes(self, max_num_seqs: int) -> tuple[int, ...]:
        return tuple(sorted(set(s for s in self.cudagraph_capture_sizes if s <= max_num_seqs)))


@dataclass(frozen=True)
class ParallelConfig:
    """How many ranks share the model (see atom_core/distributed/).

    tensor_parallel_size ranks hold one replica (over nnodes nodes, an equal share each);
    data_parallel_size replicas (engine cores, one node) serve behind one API process;
    enable_expert_parallel: MoE layers give each rank whole experts instead of a slice of every
    expert; with data_parallel_size > 1 the experts split over the replicas (`experts_span_replicas`).
    master_addr/master_port: where the ranks of a replica meet (a free local port when unset on one
    node; required with nnodes > 1); with experts_span_replicas, where the replicas meet.
    data_parallel_rank: which replica this engine core is; set by the data-parallel engine on each
    replica's config when the replicas step together (experts_span_replicas), None otherwise.
    """

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    data_parallel_rank: int | None = None

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            _fail(self, "tensor_parallel_size", "must be >= 1")
        if self.data_parallel_size < 1:
            _fail(self, "data_parallel_size", "must be >= 1")
        if self.enable_expert_parallel and self.tensor_parallel_size == 1 and self.data_parallel_size == 1:
            _fail(self, "enable_expert_parallel", "splits experts over the tensor-parallel ranks or the data-parallel "
                                                  "replicas; it needs tensor_parallel_size > 1 or "
                                                  "data_parallel_size > 1")
        if self.experts_span_replicas and self.tensor_parallel_size > 1:
            _fail(self, "tensor_parallel_size", f"with data_parallel_size={self.data_parallel_size} and "
                                                "enable_expert_parallel each replica is one rank of the expert group "
                                                "(DP attention + EP experts); tensor parallelism inside a replica is "
                                                "not supported there: use tensor_parallel_size=1")
        if self.data_parallel_rank is not None and not (
                self.experts_span_replicas and 0 <= self.data_parallel_rank < self.data_parallel_size):
            _fail(self, "data_parallel_rank", "is set by the data-parallel engine for replicas that share experts "
                                              "(enable_expert_parallel), in [0, data_parallel_size="
                                              f"{self.data_parallel_size})")
        if self.nnodes < 1:
            _fail(self, "nnodes", "must be >= 1")
        if not 0 <= self.node_rank < self.nnodes:
            _fail(self, "node_rank", f"must be in [0, nnodes={self.nnodes})")
        if self.tensor_parallel_size % self.nnodes:
            _fail(self, "nnodes", f"must divide tensor_parallel_size={self.tensor_parallel_size} "
                                  "(each node runs an equal share of the ranks)")
        if self.nnodes > 1 and self.data_parallel_size > 1:
            _fail(self, "data_parallel_size", "data-parallel replicas run on one node; use nnodes=1")
        if self.nnodes > 1 and self.master_port is None:
            _fail(self, "master_port", "required with nnodes > 1 (every node must name the same address and port)")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            _fail(self, "master_port", "must be in [1, 65535]")

    @property
    def experts_span_replicas(self) -> bool:
        """DP attention + EP experts: each replica runs attention on its own requests, its MoE layers'
        experts split over all replicas (one expert-parallel group), and the replicas step in lock-step
        (an idle one runs dummy forwards). The one place that decides the mode."""
        return self.data_parallel_size > 1 and self.enable_expert_parallel

    @property
    def world_size(self) -> int:
        """Ranks of one replica (its torch.distributed world; with experts_span_replicas, the
        replicas share one world of data_parallel_size ranks instead)."""
        return self.tensor_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The global ranks this node runs."""
        return range(self.node_rank * self.ranks_per_node, (self.node_rank + 1) * self.ranks_per_node)


SPEC_METHODS = {"ngram": 8, "draft": 8, "mtp": 4, "eagle3": 8}  # method -> the most draft tokens it may propose per step
DRAFT_MODEL_METHODS = ("draft", "eagle3")  # the methods --draft-model names a directory for


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (atom_core/spec_decode/): a proposer drafts up to
    num_speculative_tokens tokens per decoding request, the target model verifies them in one
    forward and a rejection sampler keeps its distribution. ngram: prompt lookup over the
    request's own tokens, matching its last ngram_max..ngram_min tokens (both default to 5, as
    vLLM's prompt lookup; one given sets the other); draft: greedy tokens of draft_model, a small
    model of the same tokenizer; mtp: the checkpoint's own nextn layer (DeepSeek-V3 layout),
    run k times; eagle3: an EAGLE-3 head (draft_model: its directory, public checkpoint layout)
    fed by the target's low, middle and high layers, run k times. Speculation replaces
    multi-step windows."""

    method: str | None = None
    num_speculative_tokens: int | None = None
    ngram_min: int | None = None
    ngram_max: int | None = None
    draft_model: str | None = None

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if self.method is None:
            for name in ("num_speculative_tokens", "ngram_min", "ngram_max", "draft_model"):
                if getattr(self, name) is not None:
                    _fail(self, name, "needs a speculative method (--method)")
            return
        if self.method not in SPEC_METHODS:
            _fail(self, "method", f"expected one of: {', '.join(SPEC_METHODS)}")
        if k is None and self.method != "mtp":  # mtp: one draft per nextn layer step by default
            _fail(self, "num_speculative_tokens", f"required with method {self.method}")
        if not 1 <= self.num_draft_tokens <= SPEC_METHODS[self.method]:
            _fail(self, "num_speculative_tokens", f"must be between 1 and {SPEC_METHODS[self.method]} for {self.method}")
        if (self.method in DRAFT_MODEL_METHODS) != (self.draft_model is not None):
            _fail(self, "draft_model", "a draft model directory is required with methods draft and eagle3, "
                                       "and only there")
        if self.method != "ngram" and (self.ngram_min is not None or self.ngram_max is not None):
            _fail(self, "ngram_min" if self.ngram_min is not None else "ngram_max", "applies to method ngram only")
        lo, hi = self.ngram_window
        if lo < 1 or hi < lo:
            _fail(self, "ngram_min", f"the ngram window must satisfy 1 <= ngram_min <= ngram_max (got {lo}..{hi})")

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens per request and step (0: speculation is off; mtp defaults to 1, the depth
        its one nextn layer was trained for)."""
        if self.num_speculative_tokens is None:
            return 1 if self.method == "mtp" else 0
        return self.num_speculative_tokens

    @property
    def ngram_window(self) -> tuple[int, int]:
        lo, hi = self.ngram_min, self.ngram_max
        if lo is None and hi is None:
            return 5, 5
        return (hi if lo is None else lo), (lo if hi is None else hi)


@dataclass(frozen=True)
class ProfilerConfig:
    """torch profiler output; mark_trace adds a record_function range per module (and turns
    compile off, which would drop them). profiler_rank_dir: this engine core's subdirectory of
    torch_profiler_dir (None: rank_0); the data-parallel engine sets dp{d}_tp0 on each replica,
    whose traces would otherwise all land in rank_0."""

    torch_profiler_dir: str | None = None
    profiler_detailed: bool = False
    mark_trace: bool = False
    profiler_rank_dir: str | None = None

    def __post_init__(self) -> None:
        d = self.profiler_rank_dir
        if d is not None and (not d or d in (".", "..") or "/" in d or "\\" in d):
            _fail(self, "profiler_rank_dir", "must be one directory name (no path separators)")


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's option names): enable_lora lets requests name PEFT adapters (by
    `model` over the API, `lora=` in LLMEngine.generate); lora_modules, NAME=PATH entries or vLLM's
    JSON objects ({"name", "path", "base_model_name"}), are served from the start, more load at run time. max_loras adapters sit in GPU slots at once (a step never
    mixes more); the others' weights wait in a CPU cache of max_cpu_loras (default max_loras), least
    recently used out first. max_lora_rank bounds every adapter's rank (the slots' width)."""

    enable_lora: bool = False
    lora_modules: tuple[str, ...] = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if not self.enable_lora:
            for name, default in (("lora_modules", ()), ("max_loras", 1), ("max_lora_rank", 16),
                                  ("max_cpu_loras", None)):
                if getattr(self, name) != default:
                    _fail(self, name, "needs --enable-lora")
            return
        if self.max_loras < 1:
            _fail(self, "max_loras", "must be >= 1")
        if self.max_lora_rank < 1:
            _fail(self, "max_lora_rank", "must be >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            _fail(self, "max_cpu_loras", f"must be >= max_loras={self.max_loras}")
        parse_lora_modules(self.lora_modules)

    @property
    def modules(self) -> list[LoRAModule]:
        """lora_modules parsed: (name, path, base_model_name) each."""
        return parse_lora_modules(self.lora_modules)

    @property
    def cpu_cache_size(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


_PARTS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "compile": CompileConfig,
          "parallel": ParallelConfig, "speculative": SpeculativeConfig, "profiler": ProfilerConfig,
          "kernel": KernelConfig, "lora": LoRAConfig}
_NULLABLE = {"max_cpu_loras", "max_model_len", "num_kv_blocks", "tokenizer", "torch_profiler_dir", "master_port", "method",
             "num_speculative_tokens", "ngram_min", "ngram_max", "draft_model", "data_parallel_rank",
             "profiler_rank_dir"}


@dataclass(frozen=True)
class EngineConfig:
    """The whole engine's settings, one part per component."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    kernel: KernelConfig = field(default_factory=KernelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        sched, max_len = self.scheduler, self.model.max_model_len
        if not sched.enable_chunked_prefill and max_len is not None and sched.max_num_batched_tokens < max_len:
            _fail(sched, "max_num_batched_tokens", "must be >= max_model_len without chunked prefill")
        if self.parallel.experts_span_replicas:  # the replicas' MoE collectives need one forward per step each
            why = ("data-parallel replicas sharing experts (enable_expert_parallel) run one forward per step in "
                   "lock-step; {} changes the number of forwards per step")
            if sched.num_scheduler_steps > 1:
                _fail(sched, "num_scheduler_steps", why.format("a multi-step window") + ": use num_scheduler_steps=1")
            if self.speculative.method is not None:
                _fail(self.speculative, "method", why.format("speculative decoding"))

    @property
    def torch_device(self) -> torch.device:
        return self.model.torch_device

    @property
    def use_cuda_graphs(self) -> bool:
        # Replicas sharing experts replay decode graphs at one padded size agreed every step
        # (engine/lockstep.py), the MoE all-gather's shape; the all-to-all exchange runs eagerly.
        if self.parallel.experts_span_replicas and not self.replica_graphs_allowed:
            return False
        return self.compile.use_cuda_graphs(self.torch_device)

    @property
    def replica_graphs_allowed(self) -> bool:
        """Whether replicas sharing experts may replay decode graphs: with the all-gather exchange only
        (the all-to-all sizes its messages on the host every layer, which a graph cannot replay)."""
        return self.kernel.ep_dispatch == "allgather"

    @property
    def use_compile(self) -> bool:
        return self.compile.use_compile(self.torch_device, self.profiler.mark_trace)

    @property
    def capture_sizes(self) -> tuple[int, ...]:
        return self.compile.capture_sizes(self.scheduler.max_num_seqs)

    @property
    def piecewise_sizes_used(self) -> bool:
        """Whether this engine captures piecewise graphs (its mode asks for them and it captures graphs)."""
        return self.use_cuda_graphs and self.compile.cudagraph_mode != "full_decode_only"

    @property
    def piecewise_sizes(self) -> tuple[int, ...]:
        return self.compile.piecewise_sizes(self.scheduler.max_num_batched_tokens)

    def replace(self, **options) -> "EngineConfig":
        """A copy with some flat options changed (same names as from_kwargs)."""
        parts = _split_options(options)
        return dataclasses.replace(self, **{name: dataclasses.replace(getattr(self, name), **values)
                                            for name, values in parts.items()})

    @classmethod
    def from_kwargs(cls, model: str | os.PathLike, **options) -> "EngineConfig":
        """Build from flat keyword options; unknown names are rejected with the known ones listed.
        None means "the default" except for options whose default is None. A kernel option left
        unset takes its ATOM_* variable (envs.py), read here, once."""
        for name in ("cudagraph_capture_sizes", "piecewise_capture_sizes", "lora_modules"):
            if options.get(name) is not None:
                options[name] = tuple(options[name])
        options = {k: v for k, v in options.items() if v is not None or k in _NULLABLE}
        options = {**read_envs().kernel_options(), **options}
        if "cudagraph_mode" not in options:
            probe = cls._build(model, {k: v for k, v in options.items() if k != "piecewise_capture_sizes"})
            if probe.use_cuda_graphs and not probe.parallel.experts_span_replicas:
                options["cudagraph_mode"] = DEFAULT_GRAPH_MODE
        config = cls._build(model, options)
        if config.parallel.experts_span_replicas:
            _check_replica_graphs(config, options)
        return config

    @classmethod
    def _build(cls, model: str | os.PathLike, options: dict) -> "EngineConfig":
        parts = _split_options({"model": os.fspath(model), **options})
        return cls(**{name: _PARTS[name](**values) for name, values in parts.items()})


# serve's piecewise buckets: steps that carry a whole 1,024-token prompt chunk replay too (the
# default ladder to 512, then every 64 tokens to 2,048). A loaded server's steps mix prefill chunks
# with decode, so without these buckets most of its steps would run eagerly; measured faster than
# full_decode_only under concurrent load: see docs/PERFORMANCE.md.
SERVE_PIECEWISE_SIZES = DEFAULT_PIECEWISE_SIZES + tuple(range(576, 2049, 64))


# serve's prompt policy: the mixed-step cap (SchedulerConfig.mixed_step_tokens_per_seq), R tokens per
# live request, measured on the H200 against vLLM (docs/PERFORMANCE.md): the earliest first token, at a
# higher time per output token. The prefill hold (--prefill-hold-fraction) is the alternative the
# serving model (benchmarks/engine/serve_sim.py, docs/SERVING.md) puts near vLLM's time per output token;
# it becomes the default only once a served run on the GPU shows it ahead.
SERVE_MIXED_STEP_TOKENS_PER_SEQ = 8


def serve_prompt_policy(options: dict) -> dict:
    """serve's options with its prompt policy filled in: the mixed-step cap at
    SERVE_MIXED_STEP_TOKENS_PER_SEQ unless the options choose a policy themselves (the hold, the cap or
    pacing, 0 included) or turn chunked prefill off."""
    chosen = ("prefill_hold_fraction", "mixed_step_tokens_per_seq", "prefill_pacing_steps")
    if any(options.get(name) is not None for name in chosen) or not options.get("enable_chunked_prefill", True):
        return options
    return {**options, "mixed_step_tokens_per_seq": SERVE_MIXED_STEP_TOKENS_PER_SEQ}


def serving_config(**options) -> EngineConfig:
    """serve's engine: from_kwargs, with
    - piecewise buckets to 2,048 tokens (SERVE_PIECEWISE_SIZES) where the engine's default mode
      captures piecewise graphs, so the mixed prefill + decode steps of a loaded server replay graphs
      too; not where the options chose the mode or the buckets (--piecewise-capture-sizes alone sets
      them);
    - serve's prompt policy (serve_prompt_policy)."""
    options = serve_prompt_policy(options)
    config = EngineConfig.from_kwargs(**options)
    if options.get("cudagraph_mode") or options.get("piecewise_capture_sizes") or not config.piecewise_sizes_used:
        return config
    sizes = serve_piecewise_sizes(config.scheduler.max_num_batched_tokens)
    return EngineConfig.from_kwargs(**{**options, "piecewise_capture_sizes": sizes})


def serve_piecewise_sizes(max_num_batched_tokens: int) -> tuple[int, ...]:
    """SERVE_PIECEWISE_SIZES for a token budget: as the default ladder, a budget below 2,048 is the
    largest bucket (a full step replays)."""
    budget = max_num_batched_tokens
    return tuple(sorted({s for s in SERVE_PIECEWISE_SIZES if s < budget} | {min(budget, SERVE_PIECEWISE_SIZES[-1])}))


def _check_replica_graphs(config: "EngineConfig", options: dict) -> None:
    """Replicas sharing experts replay only full decode graphs, and none with the all-to-all exchange:
    graphs asked for there would silently not happen (use_cuda_graphs), so they fail here."""
    piecewise = [k for k in ("piecewise_capture_sizes",) if k in options]
    if options.get("cudagraph_mode", "full_decode_only") != "full_decode_only":
        piecewise.append("cudagraph_mode")
    graphs = [k for k in ("level", "cudagraph_capture_sizes", "cudagraph_mode")
              if k in options and k not in piecewise and (k != "level" or options[k] in (1, 3))]
    flags = lambda keys: " ".join(f"--{k.replace('_', '-')}={options[k]}" for k in keys)  # noqa: E731
    if piecewise:
        raise ValueError(f"{flags(piecewise)}: data-parallel replicas sharing experts (enable_expert_parallel) replay "
                         "full decode graphs only (mixed steps run eagerly); drop the option")
    if graphs and not config.replica_graphs_allowed:
        raise ValueError(f"{flags(graphs)}: data-parallel replicas sharing experts (enable_expert_parallel) run without "
                         "CUDA graphs under ep_dispatch=alltoall (--ep-dispatch / ATOM_EP_DISPATCH); use --level 2 "
                         "(torch.compile) or 0, or ep_dispatch=allgather")


def _split_options(options: dict) -> dict[str, dict]:
    owner = {f.name: part for part, cls in _PARTS.items() for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - set(owner))
    if unknown:
        raise ValueError(f"unknown engine option(s) {unknown}; known: {', '.join(sorted(owner))}")
    parts: dict[str, dict] = {}
    for name, value in options.items():
        parts.setdefault(owner[name], {})[name] = value
    return parts


def config_dtype(hf_config) -> torch.dtype | None:
    """The HF config's `dtype` (a name or a torch.dtype); None when absent or not a torch dtype."""
    dtype = getattr(hf_config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None

