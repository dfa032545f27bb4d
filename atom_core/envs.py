"""Every ATOM_* environment variable, typed and read in one place.

Read once at startup (`read_envs()`), then passed on as config; nothing else in the package
reads `os.environ` for ATOM_* names. A malformed value is a ValueError naming the variable.

To add a variable: a field on `AtomEnvs`, a line in `ENV_VARS`, a line in `read_envs`.

Booleans accept 1/0, true/false, yes/no, on/off (any case); unset or empty means the default.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

ENV_VARS: dict[str, str] = {
    "ATOM_TORCH_PROFILER_DIR": "default for --torch-profiler-dir: where torch profiler traces go",
    "ATOM_PROFILER_DETAILED": "0/1: record shapes, Python stacks and memory in traces",
    "ATOM_MARK_TRACE": "0/1: wrap every model module in a named profiler range (eager mode only)",
    "ATOM_API_KEY": "default for `atomctl serve --api-key` (keeps the key out of the process list)",
    "ATOM_FP8_SMALL_M_KERNEL": "auto (default), scaled_mm, triton or gemv: the CUDA kernel of FP8 linears at few "
                               "tokens; auto = the weight-only GEMV (kernels/triton/fp8_gemv.py) for dynamic per-channel "
                               "and block FP8 at 1 token, else scaled_mm (per-channel) and the Triton block GEMM (block "
                               "FP8), the fastest on the H100 (docs/PERFORMANCE.md 2026-11-26, fourth and seventh sessions); "
                               "scaled_mm / triton = that kernel at M <= 16 (kernels/triton/fp8_gemm.py); gemv = the "
                               "GEMV at M <= 4 for dynamic per-channel and block FP8; w8a16 = the 1-token GEMV, then "
                               "the weight-only GEMM of kernels/triton/fp8_w8a16.py at 2-64 tokens (dynamic per-channel)",
    "ATOM_MOE_DECODE_PATH": "gemv (default) or tiled: the unquantized fused MoE kernels on CUDA for decode batches "
                            "(<= 2 tokens, tokens x top_k <= 32); gemv = kernels/triton/moe_decode.py, faster there "
                            "on the H100 (docs/PERFORMANCE.md 2026-11-26)",
    "ATOM_PREFILL_ATTENTION": "contiguous (default) or paged: on CUDA, sequences without cached context (a prompt's "
                              "first chunk) attend over the step's own K/V rows (kernels/triton/prefill_attention.py; "
                              "faster on the H100, docs/PERFORMANCE.md 2026-11-26) or over the paged cache",
    "ATOM_MIXED_ATTENTION": "split (default) or single: on CUDA, a step with both decodes and chunks with cached "
                            "context runs them in two paged-attention launches (decode tile, split-KV; chunk tile) "
                            "or in one launch sized by the longest query (kernels/triton/attention.py)",
    "ATOM_MTP_GRAPHS": "0/1 (default 0 until run on a GPU): with CUDA graphs, the MTP layer's catch-up and later "
                       "drafts replay graphs too (spec_decode/mtp_graphs.py) instead of running eagerly",
    "ATOM_DENSE_SMALL_M_KERNEL": "auto (default), linear or gemv: unquantized linears on CUDA run F.linear (cuBLAS) "
                                 "or the Triton GEMV of kernels/triton/dense_gemv.py; auto = the GEMV at 1 token (faster "
                                 "on the H100, docs/PERFORMANCE.md 2026-11-26, fourth session), gemv = at <= 4 tokens",
    "ATOM_DP_EP_GRAPHS": "0/1 (default: on with ATOM_EP_DISPATCH=allgather): data-parallel replicas sharing experts "
                         "replay decode steps in CUDA graphs at one padded size they agree on each step "
                         "(engine/lockstep.py) instead of running eagerly (Qwen3-30B-A3B DP=2 nano on 2x H100: "
                         "5,830 vs 1,092 tok/s); 1 with alltoall is refused",
    "ATOM_EP_DISPATCH": "allgather (default) or alltoall: how data-parallel replicas sharing experts move tokens "
                        "to the experts' ranks (all-gather + reduce-scatter, or all-to-all to the owners only; "
                        "distributed/moe_all_to_all.py)",
    "ATOM_ALL_REDUCE": "auto (default), nccl or symm: tensor-parallel all-reduces up to 16 MiB on CUDA through "
                       "PyTorch symmetric memory (one-shot to 256 KiB, two-shot above; distributed/symm_all_reduce.py) "
                       "instead of NCCL; auto where it can run (ranks on one host), else NCCL; symm fails at start "
                       "where it cannot run",
    "ATOM_W4A16_GEMV": "f16x2 (default) or triton: the W4A16 decode GEMV on CUDA (int4 linears at <= 8 tokens); "
                       "f16x2 = the packed-half2 kernel (kernels/triton/w4a16_gemv_f16x2.py) for symmetric int4 in the "
                       "kernel layout with bf16/fp16 activations (other int4 weights take triton), triton = the "
                       "float32 kernel of kernels/triton/w4a16.py (H100: Llama-3-8B W4A16 batch 1 3.65 vs 3.91 ms, "
                       "docs/PERFORMANCE.md 2026-11-26, eighth session)",
    "ATOM_W8A16_WIDEN": "convert (default) or ptx: how the weight-only FP8 GEMM (kernels/triton/fp8_w8a16.py) widens "
                        "e4m3 weights for bf16 activations on CUDA; convert = Triton's conversion, ptx = an exact "
                        "inline-PTX widening with a third of the conversion instructions (not yet timed on a GPU); "
                        "fp16/fp32 activations always convert",
    "ATOM_TRITON_FAST_LAUNCH": "1 (default) or 0: relaunch the attention and RoPE + KV-store Triton kernels of a step's "
                               "layers through the compiled kernel's own launcher instead of Triton's JIT call path "
                               "(kernels/triton/common.PlannedLaunch; ~51 vs ~11 us of host a launch on the H100 host)",
}
DenseSmallMKernel = Literal["auto", "linear", "gemv"]
DENSE_SMALL_M_KERNELS: tuple[str, ...] = get_args(DenseSmallMKernel)
EpDispatch = Literal["allgather", "alltoall"]
EP_DISPATCHES: tuple[str, ...] = get_args(EpDispatch)
AllReduceMode = Literal["auto", "nccl", "symm"]
ALL_REDUCE_MODES: tuple[str, ...] = get_args(AllReduceMode)
Fp8SmallMKernel = Literal["auto", "scaled_mm", "triton", "gemv", "w8a16"]
FP8_SMALL_M_KERNELS: tuple[str, ...] = get_args(Fp8SmallMKernel)
MoeDecodePath = Literal["tiled", "gemv"]
MOE_DECODE_PATHS: tuple[str, ...] = get_args(MoeDecodePath)
PrefillAttentionMode = Literal["contiguous", "paged"]
PREFILL_ATTENTION_MODES: tuple[str, ...] = get_args(PrefillAttentionMode)
MixedAttentionMode = Literal["split", "single"]
MIXED_ATTENTION_MODES: tuple[str, ...] = get_args(MixedAttentionMode)
W4a16Gemv = Literal["triton", "f16x2"]
W4A16_GEMVS: tuple[str, ...] = get_args(W4a16Gemv)
W8a16Widen = Literal["convert", "ptx"]
W8A16_WIDENS: tuple[str, ...] = get_args(W8a16Widen)

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class AtomEnvs:
    """The ATOM_* settings of this process; the defaults are what an empty environment gives."""

    torch_profiler_dir: str | None = None
    profiler_detailed: bool = False
    mark_trace: bool = False
    api_key: str | None = field(default=None, repr=False)  # a secret: never in logs or tracebacks
    fp8_small_m_kernel: Fp8SmallMKernel = "auto"  # read once by quant/fp8_ops when it is imported
    moe_decode_path: MoeDecodePath = "gemv"  # read once by kernels/triton/moe_decode when it is imported
    prefill_attention: PrefillAttentionMode = "contiguous"  # read once by kernels/triton/prefill_attention on import
    mixed_attention: MixedAttentionMode = "split"  # read once by kernels/triton/attention on import
    mtp_graphs: bool = False  # read by the model runner when it captures graphs
    all_reduce: AllReduceMode = "auto"  # read by distributed.init_distributed
    dense_small_m_kernel: DenseSmallMKernel = "auto"  # read once by quant/unquantized when it is imported
    ep_dispatch: EpDispatch = "allgather"  # read once by model_ops/moe when it is imported
    dp_ep_graphs: bool | None = None  # read by EngineConfig (use_cuda_graphs) for replicas sharing experts; None = unset
    w4a16_gemv: W4a16Gemv = "f16x2"  # read once by kernels/triton/w4a16 when it is imported
    w8a16_widen: W8a16Widen = "convert"  # read once by kernels/triton/fp8_w8a16 when it is imported
    triton_fast_launch: bool = True  # read once by kernels/triton/common at the first planned launch


def check_choice(value: str, choices: tuple[str, ...], what: str) -> str:
    """A process-wide switch's setter argument (benchmarks, tests), or a ValueError listing the choices."""
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}; expected one of: {', '.join(choices)}")
    return value


def read_envs(environ: Mapping[str, str] | None = None) -> AtomEnvs:
    """Parse the ATOM_* variables of `environ` (default: os.environ)."""
    env = os.environ if environ is None else environ
    return AtomEnvs(
        torch_profiler_dir=env_str(env, "ATOM_TORCH_PROFILER_DIR"),
        profiler_detailed=env_bool(env, "ATOM_PROFILER_DETAILED", False),
        mark_trace=env_bool(env, "ATOM_MARK_TRACE", False),
        api_key=env_str(env, "ATOM_API_KEY"),
        fp8_small_m_kernel=env_choice(env, "ATOM_FP8_SMALL_M_KERNEL", FP8_SMALL_M_KERNELS, "auto"),
        moe_decode_path=env_choice(env, "ATOM_MOE_DECODE_PATH", MOE_DECODE_PATHS, "gemv"),
        prefill_attention=env_choice(env, "ATOM_PREFILL_ATTENTION", PREFILL_ATTENTION_MODES, "contiguous"),
        mixed_attention=env_choice(env, "ATOM_MIXED_ATTENTION", MIXED_ATTENTION_MODES, "split"),
        mtp_graphs=env_bool(env, "ATOM_MTP_GRAPHS", False),
        all_reduce=env_choice(env, "ATOM_ALL_REDUCE", ALL_REDUCE_MODES, "auto"),
        dense_small_m_kernel=env_choice(env, "ATOM_DENSE_SMALL_M_KERNEL", DENSE_SMALL_M_KERNELS, "auto"),
        ep_dispatch=env_choice(env, "ATOM_EP_DISPATCH", EP_DISPATCHES, "allgather"),
        dp_ep_graphs=env_bool(env, "ATOM_DP_EP_GRAPHS", None),
        w4a16_gemv=env_choice(env, "ATOM_W4A16_GEMV", W4A16_GEMVS, "f16x2"),
        w8a16_widen=env_choice(env, "ATOM_W8A16_WIDEN", W8A16_WIDENS, "convert"),
        triton_fast_launch=env_bool(env, "ATOM_TRITON_FAST_LAUNCH", True),
    )


def read_torchrun_env(environ: Mapping[str, str] | None = None) -> dict:
    """The multi-node options torchrun's environment implies ({} when not launched by torchrun).

    torchrun starts one `atomctl` per node (`--nproc-per-node 1`), which starts that node's
    ranks itself: nnodes = WORLD_SIZE, node_rank = GROUP_RANK (the node's index), and the
    ranks meet at MASTER_ADDR, port MASTER_PORT + 1 (torchrun's own store listens on MASTER_PORT).
    """
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" not in env and "GROUP_RANK" not in env:
        return {}
    if env_int(env, "LOCAL_WORLD_SIZE", 1) != 1:
        raise ValueError(f"under torchrun, start one atomctl per node (--nproc-per-node 1; got "
                         f"LOCAL_WORLD_SIZE={env['LOCAL_WORLD_SIZE']}): it starts the node's ranks itself")
    out = {"nnodes": env_int(env, "WORLD_SIZE", 1), "node_rank": env_int(env, "GROUP_RANK", 0)}
    if env_str(env, "MASTER_ADDR"):
        out["master_addr"] = env_str(env, "MASTER_ADDR")
    if env_str(env, "MASTER_PORT"):
        out["master_port"] = env_int(env, "MASTER_PORT", 0) + 1
    return out


def env_str(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name, "").strip()
    return value or None


def env_bool(env: Mapping[str, str], name: str, default: bool | None) -> bool | None:
    value = env.get(name, "").strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"invalid {name}={env[name]!r}; expected one of: 0, 1 (or true/false, yes/no, on/off)")


def env_choice(env: Mapping[str, str], name: str, choices: tuple[str, ...], default: str) -> str:
    value = env.get(name, "").strip().lower()
    if not value:
        return default
    if value not in choices:
        raise ValueError(f"invalid {name}={env[name]!r}; expected one of: {', '.join(choices)}")
    return value


def env_int(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"invalid {name}={env[name]!r}; expected an integer") from None
