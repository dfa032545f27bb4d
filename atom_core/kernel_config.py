"""The engine's kernel and communication choices: one frozen config part, and the per-M kernel tables
layers build from their weights.

`KernelConfig` is resolved once at engine start (`EngineConfig.from_kwargs`): an option given as a
CLI flag or an `EngineConfig` keyword wins; an option left unset takes its ATOM_* environment
variable (parsed in `envs.py`), else the default. Nothing reads the environment after that.

How a layer gets its choices: the model runner builds the model (and a proposer's model) inside
`building(config.kernel)`; a layer that needs a choice reads `build_kernel_config()` in its
`__init__`, keeps what it needs as attributes, and never asks again. Outside `building` (a layer
built by a test) it gets the defaults.

Choices that depend on a layer's weights (which GEMM or GEMV runs at M tokens) are no switch at
all: the layer makes a `KernelTable` from its weight's device, dtype and shape when it is built or
after its weights are loaded, and its forward only looks its M up in that table.
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from atom_core.envs import ALL_REDUCE_MODES, EP_DISPATCHES, AllReduceMode, EpDispatch


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"invalid kernel option {name}={value!r} (--{name.replace('_', '-')}); "
                         f"expected one of: {', '.join(choices)}")


@dataclass(frozen=True)
class KernelConfig:
    """Kernel and communication choices a user may need to make (each also an `atomctl` flag and an
    ATOM_* variable; the flag wins):

    ep_dispatch: how data-parallel replicas sharing experts move tokens to the experts' ranks:
        allgather (every replica gathers all tokens, each computes its experts, a reduce-scatter
        returns them; decode steps can replay CUDA graphs) or alltoall (each token travels to its
        experts' owners only; sized on the host every layer, so those replicas run eagerly).
    all_reduce: tensor-parallel all-reduces on CUDA: auto (PyTorch symmetric memory for messages up
        to 16 MiB where the ranks share a host, NCCL otherwise), nccl, or symm (fails at start where
        it cannot run).
    triton_fast_launch: relaunch the attention and RoPE + KV-store kernels through the compiled
        kernel's own launcher instead of Triton's JIT call path; off for tools that hook Triton's
        launches (a registered launch hook, such as Proton's, always takes the JIT path).
    mtp_graphs: with CUDA graphs, the MTP or EAGLE-3 proposer's catch-up and later drafts replay
        graphs too instead of running eagerly.

    Resolved once by `EngineConfig.from_kwargs` (keyword or flag, else the ATOM_* variable, else the
    default). Layers get it through a build-time context: the model runner builds its models inside
    `building(config.kernel)`, and a layer reads `build_kernel_config()` in `__init__` only (FusedMoE:
    ep_dispatch; Attention / MLAAttention: their backend's launch option). The runner reads
    mtp_graphs, and the worker passes all_reduce to `init_distributed`.
    """

    ep_dispatch: EpDispatch = "allgather"
    all_reduce: AllReduceMode = "auto"
    triton_fast_launch: bool = True
    mtp_graphs: bool = False

    def __post_init__(self) -> None:
        check_choice("ep_dispatch", self.ep_dispatch, EP_DISPATCHES)
        check_choice("all_reduce", self.all_reduce, ALL_REDUCE_MODES)
        for name in ("triton_fast_launch", "mtp_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"invalid kernel option {name}={getattr(self, name)!r}; expected true or false")


KERNEL_OPTIONS: tuple[str, ...] = ("ep_dispatch", "all_reduce", "triton_fast_launch", "mtp_graphs")

_BUILDING: ContextVar[KernelConfig | None] = ContextVar("atom_kernel_config", default=None)


@contextlib.contextmanager
def building(config: KernelConfig) -> Iterator[KernelConfig]:
    """Build a model under `config`: layers constructed inside read it (`build_kernel_config`)."""
    token = _BUILDING.set(config)
    try:
        yield config
    finally:
        _BUILDING.reset(token)


def build_kernel_config() -> KernelConfig:
    """The KernelConfig of the model being built; for a layer's `__init__` only (the defaults outside
    `building`)."""
    config = _BUILDING.get()
    return KernelConfig() if config is None else config


Kernel = Callable[..., torch.Tensor]

# Tables by key: a layer's custom op passes its table's key (a 1-element CPU tensor, a graph input
# shared by every layer's graph, as Attention.layer_key), and the op finds the table here.
_TABLES: "weakref.WeakValueDictionary[int, KernelTable]" = weakref.WeakValueDictionary()


class KernelTable:
    """M-range -> kernel, made once per layer: `rows` is ((max_tokens, kernel), ...) in rising
    max_tokens; the first row whose max_tokens >= M runs M tokens, and the last row must take every M
    (max_tokens None). `dtype`: the activation dtype the table was made for (ops assert it)."""

    def __init__(self, rows: tuple[tuple[int | None, Kernel], ...], dtype: torch.dtype | None = None):
        bounds = [bound for bound, _ in rows]
        assert rows and bounds[-1] is None and None not in bounds[:-1], f"bad kernel table bounds {bounds}"
        assert bounds[:-1] == sorted(bounds[:-1]), f"kernel table bounds not rising: {bounds}"
        self.rows, self.dtype = tuple(rows), dtype
        self.key = torch.tensor([id(self)], dtype=torch.int64, device="cpu")
        _TABLES[id(self)] = self

    def __call__(self, num_tokens: int) -> Kernel:
        for bound, kernel in self.rows:
            if bound is None or num_tokens <= bound:
                return kernel
        raise AssertionError("unreachable: the last row takes every M")

    @property
    def names(self) -> tuple[tuple[int | None, str], ...]:
        """(max_tokens, kernel name) rows, for logs and tests."""
        return tuple((bound, getattr(kernel, "__name__", repr(kernel))) for bound, kernel in self.rows)

    @staticmethod
    def from_key(key: torch.Tensor) -> "KernelTable":
        return _TABLES[int(key)]  # a CPU tensor: no device sync

    def __repr__(self) -> str:
        return f"KernelTable({self.names})"
