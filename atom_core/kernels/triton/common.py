"""Shared argument checks for the Triton kernel wrappers.

The wrappers run inside CUDA-graph capture, so every check here looks only at host-side
metadata (dtype, shape, stride, device) and never at tensor values.
"""
from __future__ import annotations

import functools
import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; on the CPU (Triton's interpreter) a small
    stand-in, so the grid heuristics are still exercised."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def pin_triton_cache_dir(device_index: int = 0) -> str:
    """Point Triton's on-disk cache at Inductor's folder before anything compiles; returns it.

    Inductor sets TRITON_CACHE_DIR to its own folder when it first compiles a graph, but not
    when a later start loads that graph from its cache. Our kernels then went to Inductor's
    folder on the first start and were looked for in ~/.triton on the second, which compiled
    them all again (12 s for Llama-3-8B on the GPU machine). A user's setting is kept.
    """
    if "TRITON_CACHE_DIR" not in os.environ:
        from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

        os.environ["TRITON_CACHE_DIR"] = triton_cache_dir(device_index)
    return os.environ["TRITON_CACHE_DIR"]


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; expected one of: float16, bfloat16, float32")


def check_int(name: str, t: torch.Tensor) -> None:
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} has dtype {t.dtype}; expected int32 or int64")


def check_dim(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    # Kernels index rows through strides but assume unit stride inside a row (vector loads).
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} needs a contiguous last dim, got strides {t.stride()}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors are on different devices: {devices}")


class LaunchPlans(dict):
    """A kernel wrapper's launch plans by key (its inputs' layouts, host ints and the ids of the
    step's metadata tensors): what the layers of one step share, checked and chosen once. A plan
    keeps the tensors whose ids are in its key alive, so those ids cannot be reused by others.
    Bounded: past MAX_SIZE entries (earlier steps') it starts over."""

    MAX_SIZE = 256

    def get_or_make(self, key, make):
        plan = self.get(key)
        if plan is None:
            plan = make()
            if len(self) >= self.MAX_SIZE:
                self.clear()
            self[key] = plan
        return plan


def _launch_hooks_set() -> bool:
    """Whether a launch hook (Proton) is registered: Triton >= 3.5 keeps them in a HookChain that
    is never None (empty: no hook), older versions a callable or None."""
    import triton

    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None:
        return False
    return any(hook is not None and bool(getattr(hook, "calls", True))
               for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook))


class PlannedLaunch:
    """One Triton kernel launched again and again with the arguments of a launch plan, where only
    a few tensors change from call to call (a step's layers: their caches, query and output).

    Why: Triton's `kernel[grid](...)` binds and specializes every argument and looks the kernel
    up on each call, several times the host cost of the compiled kernel's own launcher (measured:
    see docs/PERFORMANCE.md); a piecewise mixed step makes ~100-160 launches between its graphs,
    outside any CUDA graph, so that host time is on the step's critical path. So the first call
    goes through the JIT (compiling if needed) and keeps the compiled kernel and the argument values in parameter order; later
    calls put their tensors into that list and call the compiled kernel directly.

    Safe because Triton specializes a kernel only on argument dtypes, pointer alignment (16
    bytes) and integer value classes: the plan's key fixes every argument but the per-call
    tensors, and their dtypes; their alignment picks the compiled kernel (a new pattern goes
    through the JIT once). Launch hooks (Proton), or a call with direct=False (the wrappers'
    `direct_launch`, KernelConfig.triton_fast_launch), take the JIT path every time; so does the
    interpreter (TRITON_INTERPRET=1), which compiles nothing.
    """

    def __init__(self, fn, grid: tuple, per_call: tuple[str, ...]):
        self.fn, self.grid, self.per_call = fn, tuple(grid) + (1,) * (3 - len(grid)), per_call
        self.values: list | None = None  # every kernel parameter's value, in order
        self.slots: tuple[int, ...] = ()  # where the per-call tensors go in `values`
        self.kernels: dict[tuple, object] = {}  # alignment pattern of the per-call tensors -> compiled kernel
        self.device: int | None = None

    def __call__(self, tensors: tuple, make_call, direct: bool = True) -> None:
        """tensors: the per-call tensors (or None), in `per_call` order; make_call() -> (args, kwargs):
        the whole call as `kernel[grid](*args, **kwargs)` takes it, those tensors included (built only
        when the JIT path runs); direct=False: always the JIT path."""
        key = tuple(None if t is None else t.data_ptr() % 16 == 0 for t in tensors)
        kernel = self.kernels.get(key)
        if kernel is None or not direct or _launch_hooks_set():
            self._jit_launch(key, tensors, *make_call(), direct)
            return
        values = self.values.copy()
        for slot, t in zip(self.slots, tensors):
            values[slot] = t
        g = self.grid
        kernel.run(g[0], g[1], g[2], _current_stream(self.device), kernel.function, kernel.packed_metadata,
                   None, None, None, *values)

    def _jit_launch(self, key: tuple, tensors: tuple, args: tuple, kwargs: dict, direct: bool) -> None:
        kernel = self.fn[self.grid](*args, **kwargs)
        if not direct or not _is_compiled(kernel):
            return
        if self.values is None:
            names = list(self.fn.arg_names)
            bound = self.fn.signature.bind(*args, **{k: v for k, v in kwargs.items() if k in names})
            bound.apply_defaults()
            self.values = [bound.arguments[name] for name in names]
            self.slots = tuple(names.index(name) for name in self.per_call)
            for slot in self.slots:  # the plan outlives this call: keep none of its tensors alive
                self.values[slot] = None
            self.device = next(t for t in tensors if t is not None).device.index or 0
        self.kernels[key] = kernel


def _is_compiled(kernel) -> bool:
    try:
        from triton.compiler import CompiledKernel
    except ImportError:  # pragma: no cover - every supported Triton has it
        return False
    return isinstance(kernel, CompiledKernel) and getattr(kernel, "function", None) is not None


def _current_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)
