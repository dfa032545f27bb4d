"""A CPU stand-in for CUDA graphs (piecewise.GraphKit), for the tests of the piecewise runner.

A RecordedGraph records every aten op issued between begin() and end(), with the very tensors
it read and wrote, and replay() reruns them on those tensors: the results of ops that allocate
are copied back into the tensors the capture allocated, in-place ops and views act on the same
memory again. So, as with a CUDA graph, a replay reads its inputs from the addresses the capture
saw and nothing else: a runner that put a step's inputs anywhere else would replay stale values
(the equality tests then fail). A host sync inside a capture (.item(), nonzero) fails as it would
on a GPU. Compiled (Inductor) kernels are not aten ops, so this covers eager forwards (level 1).
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_HOST_SYNCS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
               torch.ops.aten.item.default}


def _allocates(func) -> bool:
    """True when every output of `func` is new memory (no alias annotation: not a view, not in place)."""
    return all(ret.alias_info is None for ret in func._schema.returns)


class _Recorder(TorchDispatchMode):
    def __init__(self, ops: list):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_SYNCS:
            raise AssertionError(f"{func} syncs the host inside a captured graph")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out if _allocates(func) else None))
        return out


class RecordedGraph:
    def __init__(self, kit: "RecordingGraphKit"):
        self.kit = kit
        self.ops: list = []
        self._mode: _Recorder | None = None

    def begin(self) -> None:
        assert self._mode is None, "graph captured twice"
        self._mode = _Recorder(self.ops)
        self._mode.__enter__()

    def end(self) -> None:
        self._mode.__exit__(None, None, None)

    def replay(self) -> None:
        for func, args, kwargs, recorded in self.ops:
            fresh = func(*args, **kwargs)
            if recorded is None:
                continue
            for dst, src in zip(tree_flatten(recorded)[0], tree_flatten(fresh)[0]):
                if isinstance(dst, torch.Tensor) and dst.data_ptr() != src.data_ptr():
                    dst.copy_(src)
        self.kit.num_replays += 1


class RecordingGraphKit:
    def __init__(self):
        self.graphs: list[RecordedGraph] = []
        self.num_replays = 0

    def new_graph(self) -> RecordedGraph:
        graph = RecordedGraph(self)
        self.graphs.append(graph)
        return graph

    def capturing(self):
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        pass
