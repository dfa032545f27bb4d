"""Piecewise CUDA graphs for the steps vLLM runs eagerly in plugin mode.

vLLM captures full graphs of our decode steps (attention.py's builder declares single-token decode
support) but compiles and captures piecewise graphs only for the classes it compiles itself, so every
step that holds a prompt would launch each layer's kernels from Python: host-bound, a lone short
prompt's first token several times the native classes'. Our engine's own piecewise runner
(worker/piecewise.py) fills that gap here: graphs split at attention for steps up to its largest
bucket (the buckets of `atomctl serve`, to 2,048 tokens: a loaded vLLM's steps carry a prompt's
chunk beside the decodes, as our server's do), captured once at vLLM's first graph capture (the KV
caches are bound by then, and vLLM's forward context is not active, so our attention runs on the
runner's padding metadata: slot -1, nothing stored). A step vLLM runs eagerly then replays them, each layer's attention running
between the graphs with the metadata vLLM built for it (plugin/attention.py reads it per layer).

vLLM pads a step's rows past its tokens (to its own graph sizes) and its metadata covers the real
tokens only: the graphs run the real rows, and the rows vLLM added come back as zeros, as
padded_rows.py does for an eager step (nothing reads them). vLLM's memory-profiling forward (no
metadata), a step larger than the largest bucket and a forward inside a graph vLLM is capturing run
the model without our graphs (its compiled layers on CUDA: model_adapter.py).
"""
from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Callable

import torch

from atom_core.config import serve_piecewise_sizes
from atom_core.plugin.padded_rows import pad_rows, real_rows

logger = logging.getLogger("vllm.plugins.atom_core")


class PrefillGraphs:
    """Our piecewise runner over `forward(input_ids, positions)` for the steps vLLM runs eagerly.

    `metadata_of()`: this step's attention metadata of the first attention layer (None in a
    forward without metadata); `kit`: the graphs (CUDA graphs by default; the CPU tests pass a
    recording stand-in)."""

    def __init__(self, forward: Callable, layers: list, max_num_batched_tokens: int, device: torch.device,
                 metadata_of: Callable, kit=None):
        self.forward, self.layers, self.device, self.metadata_of = forward, layers, device, metadata_of
        self.sizes = serve_piecewise_sizes(max_num_batched_tokens)  # as `atomctl serve`: vLLM's steps mix too
        self.kit = kit
        self.runner = None

    def capture(self) -> None:
        """Capture every bucket once (later calls: nothing)."""
        if self.runner is not None:
            return
        from atom_core.worker.piecewise import CudaGraphKit, PiecewiseGraphRunner

        kit = self.kit if self.kit is not None else CudaGraphKit(self.device)
        runner = PiecewiseGraphRunner(self.forward, self.layers, self.sizes, self.device, kit)
        runner.capture_all()
        self.runner = runner

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The step's hidden states [rows, hidden] from the graphs, or None where it runs eagerly."""
        if self.runner is None or positions.dim() != 1 or _capturing(input_ids):
            return None
        metadata = self.metadata_of()
        if metadata is None:
            return None
        rows = input_ids.shape[0]
        real = real_rows(metadata, rows)
        if not self.runner.can_run(real):
            return None
        step = SimpleNamespace(num_tokens=real, input_ids=input_ids[:real], positions=positions[:real], attn=metadata)
        return pad_rows(self.runner.replay(step), rows)


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()
