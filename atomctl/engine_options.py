"""Engine options shared by every command that starts an engine (generate, serve, bench, profile).

`@with_engine_options` appends the options to a command's signature and hands the command
one dict, `engine_args`, of EngineConfig fields the user actually set.
"""
import functools
import inspect
import re
from typing import Optional

import typer

DEFAULT_MODEL = "demo"

ENGINE_OPTIONS = {
    "model": (str, typer.Option(DEFAULT_MODEL, "--model", "-m", help="Local HF model directory, preset:NAME, or 'demo' (the built-in model).")),
    "tokenizer": (Optional[str], typer.Option(None, help="Tokenizer directory (default: the model's).")),
    "dtype": (str, typer.Option("auto", help="auto, bfloat16, float16 or float32.")),
    "device": (str, typer.Option("auto", help="auto, cpu or cuda.")),
    "load_format": (str, typer.Option("auto", help="auto (safetensors) or dummy (random weights, for benchmarks).")),
    "quantization": (Optional[str], typer.Option(None, "--quantization", help="Weight format; must match the checkpoint's quantization_config. fp8 on a bf16/fp16 checkpoint quantizes it at load (e4m3 per-channel weights, dynamic per-token activations).")),
    "seed": (int, typer.Option(0, help="Engine seed.")),
    "max_model_len": (Optional[int], typer.Option(None, help="Max tokens per sequence (default: the model's).")),
    "max_num_seqs": (int, typer.Option(256, help="Max sequences per step.")),
    "max_num_batched_tokens": (int, typer.Option(8192, help="Token budget per step.")),
    "prefill_pacing_steps": (Optional[int], typer.Option(None, help="While sequences decode, cap a step's prompt tokens at max(--prefill-pacing-min-tokens, outstanding prompt tokens / N): a burst of prompts is spread over about N decode steps, which the decodes ride along, instead of a few full-budget steps that stall them. 0 = off (default); setting it (0 too) turns serve's prefill hold off.")),
    "prefill_pacing_min_tokens": (int, typer.Option(512, help="The smallest prompt-token cap of a paced step; only with --prefill-pacing-steps (refused without it).")),
    "mixed_step_tokens_per_seq": (Optional[int], typer.Option(None, help="While sequences decode, a step carries at most R tokens per live request (running or waiting), to the nearest multiple of 128, at least --mixed-step-min-tokens and at most --max-num-batched-tokens: the decodes, then prompt chunks in what is left. Loaded servers then run small mixed steps whose decodes ride along the prompt chunks instead of full-budget prompt steps that stall them; steps with nothing decoding take the whole budget. 0 = off (offline default); serve defaults to 8 unless --prefill-hold-fraction or --prefill-pacing-steps is given.")),
    "mixed_step_min_tokens": (int, typer.Option(256, help="The smallest cap of a mixed step; only with the mixed-step cap on (refused without it).")),
    "prefill_hold_fraction": (Optional[float], typer.Option(None, help="While sequences decode, prompts wait until at least this fraction (0-1] of the live requests are starting (waiting, or part-way through their prompt), until no request has joined the queue for two steps, or until the oldest has waited --prefill-hold-max-steps steps; then prompts take the whole --max-num-batched-tokens beside the decodes until none is starting. A loaded server then prefills in waves while few streams decode: a lower time per output token, a later first token. 0 = off (default); setting it (0 too) turns serve's mixed-step cap off.")),
    "prefill_hold_max_steps": (int, typer.Option(16, help="The most scheduler steps a prompt waits under --prefill-hold-fraction; only with it on (refused without it).")),
    "block_size": (int, typer.Option(16, help="KV cache block size in tokens.")),
    "num_kv_blocks": (Optional[int], typer.Option(None, help="Fix the KV cache size in blocks.")),
    "gpu_memory_utilization": (float, typer.Option(0.9, help="Fraction of GPU memory the engine may use.")),
    "kv_cache_memory_gb": (float, typer.Option(1.0, help="KV cache size on the CPU, in GiB.")),
    "enable_prefix_caching": (bool, typer.Option(True, "--enable-prefix-caching/--no-enable-prefix-caching")),
    "kv_cache_dtype": (str, typer.Option("auto", help="KV cache element type: auto (the model's), bf16, fp16, fp8 (= fp8_e4m3), fp8_e5m2 or fp8_per_token_head. FP8 halves the bytes per token (twice the tokens in the same memory); fp8/fp8_e5m2 store K/V divided by the layer's checkpoint k_scale/v_scale (or 1.0); fp8_per_token_head (e4m3, vLLM's name; ATOM's fp8 on AITER) stores each token's K and V of one KV head with its own float32 scale (amax / 448, 4 bytes more per head and plane; checkpoint scales are then not used). Attention reads FP8 natively.")),
    "index_cache_dtype": (str, typer.Option("auto", help="Sparse-attention indexer keys (DeepSeek-V3.2, GLM-5): auto (the model dtype, as HF computes them) or fp8 (the public recipe: the indexer's query and key Hadamard-rotated, keys stored as e4m3 with a float32 scale per 128 values, 132 instead of 256 bytes per token and layer at index_head_dim 128). Refused for models without an indexer.")),
    "enable_chunked_prefill": (bool, typer.Option(True, "--enable-chunked-prefill/--no-enable-chunked-prefill")),
    "enforce_eager": (bool, typer.Option(False, "--enforce-eager", help="No CUDA graphs, no torch.compile.")),
    "level": (int, typer.Option(3, help="0 eager, 1 CUDA graphs, 2 torch.compile, 3 compile + CUDA graphs (default).")),
    "cudagraph_capture_sizes": (Optional[str], typer.Option(None, help="Comma-separated decode batch sizes to capture.")),
    "cudagraph_mode": (Optional[str], typer.Option(None, help="CUDA graphs (levels 1 and 3): full_decode_only captures decode-only batches whole; piecewise captures every step of up to the largest --piecewise-capture-sizes tokens, split at attention, which runs eagerly between the graphs; full_and_piecewise: full graphs for decode-only batches, piecewise for the others. Default: full_and_piecewise where the engine captures graphs (serve: buckets to 2,048 tokens), full_decode_only with replicas sharing experts.")),
    "piecewise_capture_sizes": (Optional[str], typer.Option(None, help="Comma-separated token counts of the piecewise graphs' buckets (default 1,2,4, 8..248 by 8, 256..512 by 16, and for serve 576..2,048 by 64; capped at --max-num-batched-tokens); a larger step runs eagerly.")),
    "async_scheduling": (bool, typer.Option(True, "--async-scheduling/--no-async-scheduling")),
    "num_scheduler_steps": (Optional[int], typer.Option(None, help="Decode steps per host round trip while no request waits (multi-step; 1 = off). An answer that may still stop at a stop token runs windows of at most the tokens it has (1, 2, 4, ...), so a short one does not pay for full windows. Default 8; serve and profile default to 1.")),
    "torch_profiler_dir": (Optional[str], typer.Option(None, help="Write torch profiler traces here (default: $ATOM_TORCH_PROFILER_DIR).")),
    "tensor_parallel_size": (int, typer.Option(1, "--tensor-parallel-size", "-tp", help="Ranks (GPUs) one model is split over.")),
    "data_parallel_size": (int, typer.Option(1, "--data-parallel-size", "-dp", help="Engine replicas behind one balancer (serve, and bench offline), each on its own GPUs; requests go to the least busy.")),
    "enable_expert_parallel": (bool, typer.Option(False, "--enable-expert-parallel", help="MoE: each tensor-parallel rank holds whole experts (default: a slice of every expert); with -dp N the experts split over the replicas, which run attention on their own requests and step in lock-step (-tp 1, --num-scheduler-steps 1, no speculation; decode replays full CUDA graphs at one padded size the replicas agree on, mixed steps run eagerly; none with --ep-dispatch alltoall).")),
    "nnodes": (Optional[int], typer.Option(None, help="Nodes the tensor-parallel ranks span (default 1, or from torchrun's environment).")),
    "node_rank": (Optional[int], typer.Option(None, help="This node's index; node 0 runs the engine, the others only workers (default 0, or torchrun's GROUP_RANK).")),
    "master_addr": (Optional[str], typer.Option(None, help="Address of node 0, where the ranks meet (default 127.0.0.1, or torchrun's MASTER_ADDR).")),
    "master_port": (Optional[int], typer.Option(None, help="Port on node 0 where the ranks meet (default: a free port on one node; required across nodes, or torchrun's MASTER_PORT).")),
    "method": (Optional[str], typer.Option(None, help="Speculative decoding method: ngram (prompt lookup over the request's own tokens), draft (--draft-model), mtp (the checkpoint's nextn layer, DeepSeek-V3 layout; K <= 4) or eagle3 (an EAGLE-3 head, --draft-model, for Llama / Qwen3 targets).")),
    "num_speculative_tokens": (Optional[int], typer.Option(None, help="Draft tokens verified per decoding request and step (ngram, draft, eagle3: 1..8; mtp: 1..4, default 1).")),
    "draft_model": (Optional[str], typer.Option(None, help="Draft model directory for --method draft (same tokenizer as the model) or eagle3 (an EAGLE-3 head in the public layout: config.json + safetensors with fc, midlayer, lm_head, d2t/t2d).")),
    "ngram_min": (Optional[int], typer.Option(None, help="Shortest suffix n-gram the ngram method matches (default 5, or --ngram-max).")),
    "ngram_max": (Optional[int], typer.Option(None, help="Longest suffix n-gram the ngram method matches (default 5, or --ngram-min).")),
    "ep_dispatch": (Optional[str], typer.Option(None, help="How data-parallel replicas sharing experts move tokens to the experts' ranks: allgather (default; decode steps replay CUDA graphs) or alltoall (each token goes to its experts' owners only; those replicas run eagerly). Default: $ATOM_EP_DISPATCH, else allgather.")),
    "all_reduce": (Optional[str], typer.Option(None, help="Tensor-parallel all-reduces on CUDA: auto (PyTorch symmetric memory up to 16 MiB where the ranks share a host, else NCCL), nccl, or symm (fails at start where it cannot run). Default: $ATOM_ALL_REDUCE, else auto.")),
    "triton_fast_launch": (Optional[bool], typer.Option(None, "--triton-fast-launch/--no-triton-fast-launch", help="Relaunch the attention and RoPE + KV-store Triton kernels through the compiled kernel's own launcher (default on; off for tools that wrap Triton's JIT call path). Default: $ATOM_TRITON_FAST_LAUNCH, else on.")),
    "mtp_graphs": (Optional[bool], typer.Option(None, "--mtp-graphs/--no-mtp-graphs", help="With CUDA graphs and --method mtp or eagle3, replay the proposer's catch-up and later drafts in graphs too instead of running them eagerly. Default: $ATOM_MTP_GRAPHS, else off.")),
    "enable_lora": (bool, typer.Option(False, "--enable-lora", help="Serve LoRA adapters (PEFT directories) on the base model: a request names one as its model (generate: --lora NAME); requests of different adapters and of the base share each step.")),
    "lora_modules": (Optional[list[str]], typer.Option(None, "--lora-modules", help="Adapters served from the start, as NAME=PATH or vLLM's JSON {\"name\": ..., \"path\": ..., \"base_model_name\": ...} (base_model_name: the parent /v1/models lists); several after one flag (--lora-modules a=/p b=/q) or the flag repeated (serve also loads and unloads them at run time: POST /v1/load_lora_adapter, /v1/unload_lora_adapter). Needs --enable-lora.")),
    "max_loras": (int, typer.Option(1, help="LoRA adapters resident on the GPU at once (slots); a step never mixes more. Needs --enable-lora.")),
    "max_lora_rank": (int, typer.Option(16, help="The largest adapter rank served (the slots' width); a higher-rank adapter is refused. Needs --enable-lora.")),
    "max_cpu_loras": (Optional[int], typer.Option(None, help="LoRA adapters kept in host memory (least recently used out first; default --max-loras). Needs --enable-lora.")),
}


def resolve_model_arg(model: str) -> str:
    """`demo` -> the built-in model's directory (as LLMEngine resolves it), so a server's
    /v1/models `root` and trace names carry the real path."""
    from atom_core.loader.model_dir import model_dir_name  # here: atom_core.loader imports torch

    return model_dir_name(model)


def engine_kwargs(values: dict) -> dict:
    """Option values -> EngineConfig keyword arguments (defaults left out)."""
    out = {}
    for name, (_, option) in ENGINE_OPTIONS.items():
        value = values[name]
        if name in ("cudagraph_capture_sizes", "piecewise_capture_sizes") and value is not None:
            try:
                value = tuple(int(v) for v in value.split(",") if v.strip())
            except ValueError:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"invalid {flag} {values[name]!r}; expected e.g. 1,2,4,8") from None
        if name == "model":
            value = resolve_model_arg(value)
        if value != option.default or name == "model":
            out[name] = value
    return _with_env_defaults(out)


def _with_env_defaults(kwargs: dict) -> dict:
    """ATOM_* profiling variables (read in atom_core.envs) fill what the options left unset."""
    from atom_core.envs import read_envs

    from atom_core.envs import read_torchrun_env

    for name, value in read_torchrun_env().items():  # launched by torchrun: its rendezvous, unless given
        kwargs.setdefault(name, value)
    envs = read_envs()
    if envs.torch_profiler_dir and "torch_profiler_dir" not in kwargs:
        kwargs["torch_profiler_dir"] = envs.torch_profiler_dir
    if envs.mark_trace:
        kwargs.setdefault("mark_trace", True)
    if envs.profiler_detailed:
        kwargs.setdefault("profiler_detailed", True)
    return kwargs


def with_engine_options(fn):
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.name != "engine_args"]
    for name, (annotation, option) in ENGINE_OPTIONS.items():
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation))

    @functools.wraps(fn)
    def wrapper(**kwargs):
        values = {name: kwargs.pop(name) for name in ENGINE_OPTIONS}
        return fn(engine_args=values, **kwargs)

    wrapper.__signature__ = sig.replace(parameters=params)
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper


# An argument that continues a --lora-modules list: NAME=PATH (no space before the '='), or a JSON object.
_LORA_ENTRY = re.compile(r"^[^\s=-][^\s=]*=\S|^\{")


def expand_lora_modules(args: list[str]) -> list[str]:
    """vLLM's `--lora-modules a=/p b=/q` (several values after one flag) as the repeated flags Click
    parses. The arguments after the flag's own value join it while they look like entries; the first
    that does not (an option, the model, a prompt) ends the list, and so does `--`."""
    out, state = [], "other"  # "value": the flag's own value is next; "entries": more entries may follow
    for i, arg in enumerate(args):
        if arg == "--":
            return out + args[i:]
        if state == "entries" and _LORA_ENTRY.match(arg):
            out += ["--lora-modules", arg]
            continue
        out.append(arg)
        if state == "value":
            state = "entries"
        elif arg == "--lora-modules":
            state = "value"
        else:
            state = "entries" if arg.startswith("--lora-modules=") else "other"
    return out
