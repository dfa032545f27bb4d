"""Every ATOM_* environment variable, typed and read in one place.

Read once at startup (`read_envs()`), then passed on as config; nothing else in the package
reads `os.environ` for ATOM_* names. A malformed value is a ValueError naming the variable. The
kernel variables are an override layer under the flags: `EngineConfig.from_kwargs` gives each
KernelConfig option its variable's value where no flag or keyword set it.

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
    "ATOM_EP_DISPATCH": "default for --ep-dispatch: allgather (default) or alltoall, how data-parallel replicas "
                        "sharing experts move tokens to the experts' ranks (all-gather + reduce-scatter, or "
                        "all-to-all to the owners only; alltoall runs those replicas without CUDA graphs)",
    "ATOM_ALL_REDUCE": "default for --all-reduce: auto (default), nccl or symm, how tensor-parallel all-reduces "
                       "run on CUDA (PyTorch symmetric memory up to 16 MiB where the ranks share a host, else "
                       "NCCL; nccl always NCCL, the fallback where symmetric memory misbehaves; symm fails at "
                       "start where it cannot run)",
    "ATOM_TRITON_FAST_LAUNCH": "default for --triton-fast-launch: 1 (default) or 0; 0 launches the attention and "
                               "RoPE + KV-store Triton kernels through Triton's JIT call path instead of the "
                               "compiled kernel's own launcher, for tools that wrap that path (a registered "
                               "launch hook such as Proton's already forces it)",
    "ATOM_MTP_GRAPHS": "default for --mtp-graphs: 0 (default) or 1; 1 replays the MTP proposer's catch-up and "
                       "later drafts in CUDA graphs instead of running them eagerly",
    "ATOM_DISABLE_VLLM_PLUGIN": "0 (default) or 1; 1 makes atomctl's vLLM plugin register nothing, so `vllm serve` "
                                "and vllm.LLM run vLLM's own model classes (read by the plugin in every vLLM process)",
}
# Kernel switches that were removed (their alternatives lost); setting one is an error, not a no-op.
REMOVED_ENV_VARS: tuple[str, ...] = (
    "ATOM_FP8_SMALL_M_KERNEL", "ATOM_MOE_DECODE_PATH", "ATOM_PREFILL_ATTENTION", "ATOM_MIXED_ATTENTION",
    "ATOM_DENSE_SMALL_M_KERNEL", "ATOM_DP_EP_GRAPHS", "ATOM_W4A16_GEMV", "ATOM_W8A16_WIDEN",
)
EpDispatch = Literal["allgather", "alltoall"]
EP_DISPATCHES: tuple[str, ...] = get_args(EpDispatch)
AllReduceMode = Literal["auto", "nccl", "symm"]
ALL_REDUCE_MODES: tuple[str, ...] = get_args(AllReduceMode)

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class AtomEnvs:
    """The ATOM_* settings of this process; the defaults are what an empty environment gives."""

    torch_profiler_dir: str | None = None
    profiler_detailed: bool = False
    mark_trace: bool = False
    api_key: str | None = field(default=None, repr=False)  # a secret: never in logs or tracebacks
    # Defaults of KernelConfig's fields (atom_core/kernel_config.py); None = unset, the option's default.
    ep_dispatch: EpDispatch | None = None
    all_reduce: AllReduceMode | None = None
    triton_fast_launch: bool | None = None
    mtp_graphs: bool | None = None
    disable_vllm_plugin: bool = False

    def kernel_options(self) -> dict:
        """The kernel options this environment sets (KernelConfig field -> value)."""
        names = ("ep_dispatch", "all_reduce", "triton_fast_launch", "mtp_graphs")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


def read_envs(environ: Mapping[str, str] | None = None) -> AtomEnvs:
    """Parse the ATOM_* variables of `environ` (default: os.environ)."""
    env = os.environ if environ is None else environ
    removed = [name for name in REMOVED_ENV_VARS if env.get(name, "").strip()]
    if removed:
        raise ValueError(f"{', '.join(removed)}: removed (each kernel choice it made is now fixed by the "
                         f"weights' layout or the default path); unset it. Kept: {', '.join(ENV_VARS)}")
    return AtomEnvs(
        torch_profiler_dir=env_str(env, "ATOM_TORCH_PROFILER_DIR"),
        profiler_detailed=env_bool(env, "ATOM_PROFILER_DETAILED", False),
        mark_trace=env_bool(env, "ATOM_MARK_TRACE", False),
        api_key=env_str(env, "ATOM_API_KEY"),
        ep_dispatch=env_choice(env, "ATOM_EP_DISPATCH", EP_DISPATCHES, None),
        all_reduce=env_choice(env, "ATOM_ALL_REDUCE", ALL_REDUCE_MODES, None),
        triton_fast_launch=env_bool(env, "ATOM_TRITON_FAST_LAUNCH", None),
        mtp_graphs=env_bool(env, "ATOM_MTP_GRAPHS", None),
        disable_vllm_plugin=env_bool(env, "ATOM_DISABLE_VLLM_PLUGIN", False),
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


def env_choice(env: Mapping[str, str], name: str, choices: tuple[str, ...], default: str | None) -> str | None:
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
