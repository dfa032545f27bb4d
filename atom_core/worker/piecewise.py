"""Piecewise CUDA graphs: every step up to the largest bucket replays graphs for everything but
attention, which runs eagerly between them with the step's exact metadata.

A decode-only batch has one shape per batch size, so CUDAGraphRunner captures the whole forward.
A mixed batch (prefill chunks + decodes) does not: its attention depends on the query lengths.
Everything else (embedding, norms, projections, MLP/MoE, collectives) depends only on the token
count, so it is captured per padded token count T ("bucket"), split at each attention call.

How the split happens: during a capture the runner swaps every attention layer's backend for a
stand-in (`_Capture`). The forward (eager, or the per-layer torch.compile graphs, where attention
is the opaque `atom::paged_attention` op whose implementation calls the backend) reaches attention
layer k inside graph k; the stand-in then
  1. copies the attention inputs into static buffers (part of graph k): the inputs are graph
     pool tensors the runner does not keep (keeping them would pin one copy per layer and
     bucket); positions are the runner's static buffer already and are read in place;
  2. ends graph k, begins graph k + 1 and returns a clone of the static output buffer's rows
     (part of graph k + 1), so graph k + 1 reads what the eager attention will have written
     there. A clone, not the buffer itself: the compiled layer may reuse the memory the op
     returned for later results (Inductor reuses dead buffers of the same size), which the
     next layer's attention would then overwrite.
Replay of a step with n <= T tokens: copy ids and positions into the static buffers, then for
each layer replay graph k, run the layer's own backend on rows [:n] of the static inputs (the
exact metadata: padded rows never reach attention, so the KV cache never sees them), writing rows
[:n] of the static output (backends with `writes_out` write there; others' results are copied in);
finally replay the last graph. Padded rows carry
stale but finite values; every op outside attention is row-wise in the token dimension, so they
never reach a real row. The hidden states are a view of graph memory, valid until the next
replay (as CUDAGraphRunner's).

Static buffers are sized for the largest bucket and shared by every layer and bucket (one per
input slot, shape and dtype): at replay the layers use them one after another. Assumed (true of
every family here): attention's inputs and output are token-major, and its output is consumed
(o_proj) inside the next graph. The graph capture itself is injectable (`GraphKit`): CUDA graphs
on a GPU, a recording stand-in in the CPU tests.
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import nn

from atom_core.model_ops.forward_context import AttentionMetadata, set_attention_metadata
from atom_core.worker.graph_sizes import CapturedSizes

logger = logging.getLogger(__name__)


class CapturedGraph(Protocol):
    def begin(self) -> None: ...  # start recording the work issued from now on
    def end(self) -> None: ...  # stop recording
    def replay(self) -> None: ...  # rerun the recorded work on the same memory


class GraphKit(Protocol):
    """Makes graphs and the context they are captured in."""

    def new_graph(self) -> CapturedGraph: ...
    def capturing(self): ...  # context manager around a whole capture (all segments of one bucket)
    def synchronize(self) -> None: ...


class CudaGraph:
    """One CUDA graph; raw capture_begin/capture_end (torch.cuda.graph would gc.collect and
    empty the cache at every segment: dozens per bucket)."""

    def __init__(self, pool):
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def begin(self) -> None:
        self.graph.capture_begin(pool=self.pool)

    def end(self) -> None:
        self.graph.capture_end()

    def replay(self) -> None:
        self.graph.replay()


class CudaGraphKit:
    """CUDA graphs in one memory pool (shared with the decode graphs when given theirs),
    captured on a side stream as torch.cuda.graph does."""

    def __init__(self, device: torch.device, pool=None):
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)

    def new_graph(self) -> CudaGraph:
        return CudaGraph(self.pool)

    @contextmanager
    def capturing(self):
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            yield
        torch.cuda.current_stream().wait_stream(self.stream)

    def synchronize(self) -> None:
        torch.cuda.synchronize()


class StaticBuffers:
    """Persistent token-major buffers [max_tokens, ...], one per (slot, trailing shape, dtype),
    shared by every layer and bucket: at replay the layers use them one after another."""

    def __init__(self, max_tokens: int, device: torch.device):
        self.max_tokens, self.device = max_tokens, device
        self.buffers: dict[tuple, torch.Tensor] = {}

    def get(self, slot: str, row_shape: tuple[int, ...], dtype: torch.dtype, create: bool = False) -> torch.Tensor:
        """create: allocate a missing buffer (never while capturing: it would land in the graph's
        pool and its zero-fill in the graph)."""
        key = (slot, tuple(row_shape), dtype)
        if key not in self.buffers:
            assert create, f"no static buffer for {key} (the warm-up saw other attention inputs)"
            self.buffers[key] = torch.zeros(self.max_tokens, *row_shape, dtype=dtype, device=self.device)
        return self.buffers[key]


@dataclass
class AttentionCall:
    """One attention layer's eager work between graph k and graph k + 1."""

    backend: object  # the layer's own backend
    layer: nn.Module
    inputs: list[torch.Tensor]  # static, [T, ...] each
    output: torch.Tensor  # static, [T, width]; graph k + 1 reads it

    def run(self, num_tokens: int) -> None:
        inputs, output = [x[:num_tokens] for x in self.inputs], self.output[:num_tokens]
        if getattr(self.backend, "writes_out", False):  # straight into the static buffer: no copy
            self.backend.forward(self.layer, *inputs, out=output)
            return
        output.copy_(self.backend.forward(self.layer, *inputs))


@dataclass
class BucketPlan:
    """What one bucket replays: graphs[k], then calls[k], for every k; then graphs[-1]."""

    graphs: list[CapturedGraph]
    calls: list[AttentionCall]
    hidden: torch.Tensor  # the model's output, graph memory [T, hidden]


class _ShapeProbe:
    """Stands in for every layer's backend during a bucket's warm-up: runs it, allocates the
    static buffers its inputs and output need, and notes each output's row shape and dtype (the
    capture runs no attention)."""

    def __init__(self, buffers: StaticBuffers):
        self.buffers = buffers
        self.outputs: list[tuple[tuple[int, ...], torch.dtype]] = []

    def forward(self, inner, layer, inputs):
        for slot, x in enumerate(inputs):
            self.buffers.get(f"input{slot}", x.shape[1:], x.dtype, create=True)
        out = inner.forward(layer, *inputs)
        self.buffers.get("output", out.shape[1:], out.dtype, create=True)
        self.outputs.append((tuple(out.shape[1:]), out.dtype))
        return out


class _Capture:
    """Stands in for every layer's backend during one bucket's capture (see the module doc)."""

    def __init__(self, num_tokens: int, kit: GraphKit, buffers: StaticBuffers, positions: torch.Tensor,
                 output_shapes: list):
        self.num_tokens, self.kit, self.buffers = num_tokens, kit, buffers
        self.positions = positions  # the runner's static positions: attention reads them in place
        self.output_shapes = output_shapes
        self.graphs: list[CapturedGraph] = []
        self.calls: list[AttentionCall] = []
        self.is_open = False  # a graph is recording

    def begin_graph(self) -> None:
        graph = self.kit.new_graph()
        self.graphs.append(graph)
        graph.begin()
        self.is_open = True

    def end_graph(self) -> None:
        self.is_open = False
        self.graphs[-1].end()

    def forward(self, inner, layer, inputs):
        T = self.num_tokens
        statics = []
        for slot, x in enumerate(inputs):
            assert x.shape[0] == T, f"attention input {slot} has {x.shape[0]} rows, expected {T} (token-major)"
            if x.data_ptr() == self.positions.data_ptr() and x.shape == (T,) and x.stride() == (1,):
                statics.append(x)
                continue
            static = self.buffers.get(f"input{slot}", x.shape[1:], x.dtype)[:T]
            static.copy_(x)
            statics.append(static)
        k = len(self.calls)
        assert k < len(self.output_shapes), "more attention calls in the capture than in the warm-up"
        output = self.buffers.get("output", *self.output_shapes[k])[:T]
        self.end_graph()
        self.calls.append(AttentionCall(inner, layer, statics, output))
        self.begin_graph()
        return output.clone()


class _Substitute:
    """A layer's backend while the runner captures: hands each call to the active stand-in."""

    def __init__(self, inner, stand_in):
        self.inner, self.stand_in = inner, stand_in

    def forward(self, layer, *inputs):
        return self.stand_in.forward(self.inner, layer, inputs)

    def __getattr__(self, name):  # name, supports_*, warm_up: the real backend's
        return getattr(self.inner, name)


@contextmanager
def _backends_replaced(layers: list[nn.Module], device: torch.device, stand_in):
    previous = [layer._backend for layer in layers]
    try:
        for layer in layers:
            layer._backend = _Substitute(layer.backend(device), stand_in)
        yield
    finally:
        for layer, backend in zip(layers, previous):
            layer._backend = backend


class PiecewiseGraphRunner(CapturedSizes):
    """Captures `model(input_ids, positions) -> hidden` per token bucket, split at attention;
    replays any flat batch of at most the largest bucket's tokens (prefill chunks, decodes, both).

    Contract: `capture_all()` once after the KV cache exists; `replay(flat)` for any batch with
    `can_run(flat.num_tokens)`; returns hidden states [n, hidden], a view of graph memory valid
    until the next replay. Attention layers are the model's KV-spec modules (`attention_layers`),
    each with a `backend(device)` whose `forward(layer, *token_major_tensors)` reads the forward
    context's metadata.
    """

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], layers: list[nn.Module],
                 sizes: tuple[int, ...], device: torch.device, kit: GraphKit):
        self.forward, self.layers, self.device, self.kit = forward, layers, device, kit
        self.sizes = tuple(sorted(set(sizes)))
        assert self.sizes and self.sizes[0] >= 1, "piecewise graphs need at least one positive bucket"
        self.max_tokens = self.sizes[-1]
        self.input_ids = torch.zeros(self.max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_tokens, dtype=torch.int64, device=device)
        self.buffers = StaticBuffers(self.max_tokens, device)
        self.plans: dict[int, BucketPlan] = {}
        self.capture_seconds = 0.0

    def _padding_metadata(self, num_tokens: int) -> AttentionMetadata:
        """num_tokens one-token sequences whose KV goes nowhere (slot -1) and whose linear-attention
        state is the scratch row 0: valid for any count and any max_model_len, as the decode graphs'
        padded rows."""
        dev = self.device
        ones = torch.ones(num_tokens, dtype=torch.int32, device=dev)
        return AttentionMetadata(query_start_loc=torch.arange(num_tokens + 1, dtype=torch.int32, device=dev),
                                 seq_lens=ones, block_tables=torch.zeros(num_tokens, 1, dtype=torch.int32, device=dev),
                                 slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=dev),
                                 max_query_len=1, max_seq_len=1,
                                 seq_order=torch.arange(num_tokens, dtype=torch.int32, device=dev),
                                 state_slots=torch.zeros(num_tokens, dtype=torch.int32, device=dev))

    @torch.inference_mode()
    def capture_all(self) -> None:
        start = time.perf_counter()
        for T in reversed(self.sizes):  # largest first: smaller buckets reuse its pool memory
            self.plans[T] = self._capture(T)
        self.kit.synchronize()
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured piecewise graphs for %d token buckets (%d..%d tokens, %d graphs each) in %.1f s",
                    len(self.sizes), self.sizes[0], self.max_tokens, len(self.plans[self.max_tokens].graphs),
                    self.capture_seconds)

    def _capture(self, T: int) -> BucketPlan:
        ids, pos = self.input_ids[:T], self.positions[:T]
        with set_attention_metadata(self._padding_metadata(T)):
            probe = _ShapeProbe(self.buffers)
            with _backends_replaced(self.layers, self.device, probe):
                self.forward(ids, pos)  # warm-up: compiles / autotunes this shape, notes output shapes
            self.kit.synchronize()
            capture = _Capture(T, self.kit, self.buffers, self.positions, probe.outputs)
            with self.kit.capturing(), _backends_replaced(self.layers, self.device, capture):
                capture.begin_graph()
                try:
                    hidden = self.forward(ids, pos)
                finally:  # a failed capture must not leave the stream (or the stand-in) recording
                    if capture.is_open:
                        capture.end_graph()
        assert len(capture.calls) == len(probe.outputs), "the capture made other attention calls than the warm-up"
        return BucketPlan(capture.graphs, capture.calls, hidden)

    def replay(self, flat) -> torch.Tensor:
        """flat: a FlatBatch (input_ids, positions, attn metadata of its real tokens)."""
        n = flat.num_tokens
        plan = self.plans[self.padded_size(n)]
        self.input_ids[:n].copy_(flat.input_ids, non_blocking=True)
        self.positions[:n].copy_(flat.positions, non_blocking=True)
        with set_attention_metadata(flat.attn):
            for graph, call in zip(plan.graphs, plan.calls):
                graph.replay()
                call.run(n)
            plan.graphs[-1].replay()
        return plan.hidden[:n]
