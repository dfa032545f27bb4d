"""torch profiler glue: traces per rank, named module ranges, and CUDA-graph capture traces.

Traces. `TorchProfiler.start()` / `stop()` record one torch.profiler session (CPU activity,
plus CUDA when a GPU is present) and write it as a gzip-compressed Chrome trace to
`{dir}/{rank_dir}/{model}_{YYYYmmdd_HHMMSS_mmm}.pt.trace.json.gz`, where rank_dir is
`rank_{r}` or, under data parallelism, `dp{d}_tp{r}` (`rank_dir_name`), and model is the model
name made file-safe (`sanitize_model_name`). Detailed mode adds record_shapes, with_stack and
profile_memory (much larger traces).

Module ranges (mark_trace). `mark_modules(model)` puts forward pre/post hooks on every
submodule; while a profiler is recording, each forward runs inside
`record_function(<qualified name>)`, the name as `named_modules()` gives it with one leading
`model.` removed (`model.layers.3.self_attn.qkv_proj` -> `layers.3.self_attn.qkv_proj`;
`lm_head` stays). With no profiler recording, a hook costs one flag check and a list push/pop.
Hooks with Python state break torch.compile graphs, so mark_trace is an eager-mode feature:
the engine turns compile off when it is on (`EngineConfig.use_compile`).

CUDA graphs. A replayed graph launches all its kernels from one `cudaGraphLaunch`, so replayed
kernels have no module range around their launch. With mark_trace on, the graph runner calls
`record_graph_capture(bs, capture_fn)` for every batch size it captures. That runs the capture
inside a short profiler session of its own (range `atom_graph_capture bs=N`, with the module
ranges inside it) and writes `capture_bs{N}_{model}_{timestamp}.pt.trace.json.gz` to the same
rank directory. Kernels do not execute during stream capture, so that trace holds the launch
calls only (cudaLaunchKernel, cuLaunchKernel(Ex), cudaMemcpyAsync, ... between
cudaStreamBeginCapture and cudaStreamEndCapture), each inside its module range. A graph
captured on one stream is a chain, so its replay runs the captured kernels in launch order:
the parser maps the k-th kernel of a replay (in GPU start order) to the module of the k-th
launch of the capture with the same batch size, and refuses the mapping when the counts differ.
If a profiler session is already recording when a capture happens, the capture range lands in
that trace instead, and the parser finds it there.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from atom_core.config import ProfilerConfig
from atom_core.profiling.conventions import CAPTURE_FILE_PREFIX, TRACE_SUFFIX, graph_capture_range_name

T = TypeVar("T")

NO_DIR_MESSAGE = "torch profiler dir not configured; pass --torch-profiler-dir or set ATOM_TORCH_PROFILER_DIR"


def rank_dir_name(rank: int, dp_rank: int | None = None) -> str:
    """`rank_{rank}`, or `dp{dp_rank}_tp{rank}` under data parallelism."""
    return f"rank_{rank}" if dp_rank is None else f"dp{dp_rank}_tp{rank}"


def sanitize_model_name(model: str) -> str:
    """A file-name-safe model name: a local path gives its last component (`/m/Llama-3/` ->
    `Llama-3`), a hub id or preset keeps all parts (`Qwen/Qwen3-8B` -> `Qwen_Qwen3-8B`,
    `preset:llama3-8b` -> `preset_llama3-8b`)."""
    name = model.rstrip("/\\")
    if name.startswith(("/", ".", "~")) or os.path.isdir(name):
        name = os.path.basename(name) or name
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._")
    return name or "model"


def _timestamp() -> str:
    now = time.time()
    return time.strftime("%Y%m%d_%H%M%S", time.localtime(now)) + f"_{int(now * 1000) % 1000:03d}"


def module_range_name(qualified_name: str) -> str:
    """The range name of a submodule: its qualified name less one leading `model.`."""
    return qualified_name.removeprefix("model.")


def mark_modules(model: torch.nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
    """Wrap the forward of every submodule of `model` (not `model` itself) in a profiler range
    named `module_range_name(name)`. Returns the hook handles; `h.remove()` each to undo.

    Ranges are opened only while a torch profiler records. Eager mode only (see module doc);
    one forward at a time per model (the open ranges live on one shared stack)."""
    open_ranges: list[record_function | None] = []

    def make_pre_hook(range_name: str):
        def pre_hook(module, args):
            rf = None
            if torch.autograd._profiler_enabled():
                rf = record_function(range_name)
                rf.__enter__()
            open_ranges.append(rf)

        return pre_hook

    def post_hook(module, args, output):
        rf = open_ranges.pop()
        if rf is not None:
            rf.__exit__(None, None, None)

    handles = []
    for name, module in model.named_modules():
        if not name:
            continue
        handles.append(module.register_forward_pre_hook(make_pre_hook(module_range_name(name))))
        # always_call: the range closes (and the stack stays balanced) when forward raises.
        handles.append(module.register_forward_hook(post_hook, always_call=True))
    return handles


@contextlib.contextmanager
def without_usdt_lines() -> Iterator[None]:
    """Drop the `USDT:` lines kineto (torch's profiler library) writes to stderr from C++ at every
    profiler start and stop: probe markers for tracing tools, noise on a terminal. stderr (fd 2)
    goes to a temporary file meanwhile; every other line (kineto's warnings and errors, anything
    else written then) is passed on, in order, when the block ends."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().splitlines(keepends=True) if not line.startswith(b"USDT:")]
            if kept:
                os.write(2, b"".join(kept))


class TorchProfiler:
    """One worker's torch profiler: start/stop sessions that each write one trace file, and
    capture traces for CUDA graphs. Not thread-safe; one instance per worker process."""

    def __init__(self, config: ProfilerConfig, model_name: str, rank_dir: str = "rank_0"):
        self.config = config
        self.model_name = sanitize_model_name(model_name)
        self.rank_dir = rank_dir
        self.capture_trace_paths: list[str] = []
        self._profile: profile | None = None

    @property
    def is_active(self) -> bool:
        return self._profile is not None

    @property
    def trace_dir(self) -> Path:
        if not self.config.torch_profiler_dir:
            raise ValueError(NO_DIR_MESSAGE)
        return Path(self.config.torch_profiler_dir) / self.rank_dir

    def start(self) -> None:
        """Start recording. ValueError when no directory is configured or already recording."""
        trace_dir = self.trace_dir
        if self.is_active:
            raise ValueError("torch profiler is already running; call stop_profile first")
        trace_dir.mkdir(parents=True, exist_ok=True)
        self._profile = self._new_profile(detailed=self.config.profiler_detailed)
        with without_usdt_lines():
            self._profile.start()

    def stop(self) -> list[str]:
        """Stop recording and write the trace; returns the paths written."""
        if self._profile is None:
            raise ValueError("torch profiler is not running; call start_profile first")
        prof, self._profile = self._profile, None
        with without_usdt_lines():
            prof.stop()
        return [self._export(prof, f"{self.model_name}_{_timestamp()}{TRACE_SUFFIX}")]

    def record_graph_capture(self, batch_size: int, capture_fn: Callable[[], T]) -> T:
        """Run `capture_fn` (the capture of the CUDA graph for `batch_size`) and return its
        result. With mark_trace and a directory configured, record it in a profiler session of
        its own and write `capture_bs{N}_...` beside the traces (see the module doc)."""
        range_name = graph_capture_range_name(batch_size)
        if self.is_active:
            with record_function(range_name):
                return capture_fn()
        if not (self.config.mark_trace and self.config.torch_profiler_dir):
            return capture_fn()
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        prof = self._new_profile(detailed=False)
        with without_usdt_lines():
            prof.start()
        try:
            with record_function(range_name):
                result = capture_fn()
        finally:
            with without_usdt_lines():
                prof.stop()
        name = f"{CAPTURE_FILE_PREFIX}{batch_size}_{self.model_name}_{_timestamp()}{TRACE_SUFFIX}"
        self.capture_trace_paths.append(self._export(prof, name))
        return result

    def _new_profile(self, detailed: bool) -> profile:
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        return profile(
            activities=activities,
            record_shapes=detailed,
            with_stack=detailed,
            profile_memory=detailed,
        )

    def _export(self, prof: profile, file_name: str) -> str:
        path = self.trace_dir / file_name
        prof.export_chrome_trace(str(path))  # a .gz path makes torch gzip the JSON
        return str(path)
