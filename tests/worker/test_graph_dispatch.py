"""GraphDispatcher (worker/graph_dispatch.py) on the CPU: the path of every kind of step, the graph
sets each configuration captures, when a speculative step is laid out for the verify graphs, and
forwards through the real CUDAGraphRunner / PiecewiseGraphRunner. CUDA graphs do not exist here:
the decode graphs' capture is replaced by eager stand-ins that rerun the forward on the runner's
persistent buffers (so everything around the graph runs for real), and the piecewise graphs are
recorded with tests/worker/graph_recorder.py."""
from __future__ import annotations

import pytest
import torch

from atom_core.distributed.communication import agreed_token_counts
from atom_core.model_ops.forward_context import set_attention_metadata
from atom_core.sampling_params import SamplingParams
from atom_core.scheduler_output import SchedulerOutput
from atom_core.worker.batch_builder import build_flat_batch
from atom_core.worker.cuda_graph import CUDAGraphRunner
from atom_core.worker.graph_dispatch import (Choice, GraphDispatcher, GraphPath, GraphSets, choose_path, graph_sets,
                                             verify_graph_sizes)
from atom_core.worker.input_batch import RequestState
from atom_core.worker.piecewise import PiecewiseGraphRunner
from atom_core.worker.verify_batch import build_padded_verify_batch
from tests.worker.graph_recorder import RecordingGraphKit

CPU = torch.device("cpu")
BLOCK = 4
MAX_LEN = 32


class RowModel(torch.nn.Module):
    """A row-wise stand-in for a model: each token's 'hidden state' is a function of its id and
    position only, so any path that feeds the right rows returns the eager result."""

    def __init__(self):
        super().__init__()
        self.calls: list[int] = []  # tokens per forward

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.calls.append(input_ids.shape[0])
        # * 1.0, not .float(): aten.to may alias its input, and graph_recorder replays only ops that allocate
        return torch.stack([input_ids * 100 + positions, input_ids - positions], dim=1) * 1.0


class _EagerGraph:
    def __init__(self, runner: CUDAGraphRunner, bs: int):
        self.runner, self.bs = runner, bs

    def replay(self) -> None:
        r, tokens = self.runner, self.bs * self.runner.query_len
        with set_attention_metadata(r._metadata(self.bs)):
            r.outputs[self.bs] = r.forward(r.input_ids[:tokens], r.positions[:tokens])


def _capture_eagerly(runner: CUDAGraphRunner) -> None:
    runner.graphs = {bs: _EagerGraph(runner, bs) for bs in runner.sizes}
    runner.pool = runner.pool or f"pool-of-{runner.query_len}"


@pytest.fixture
def eager_capture(monkeypatch):
    monkeypatch.setattr(CUDAGraphRunner, "capture_all", _capture_eagerly)


def _full(sizes=(1, 2, 4), query_len=1) -> CUDAGraphRunner:
    return CUDAGraphRunner(RowModel(), sizes, MAX_LEN, BLOCK, CPU, query_len=query_len)


def _piecewise(sizes=(4, 8, 16)) -> PiecewiseGraphRunner:
    return PiecewiseGraphRunner(RowModel(), [], sizes, CPU, RecordingGraphKit())


def _states(num: int, computed: int = 5, outputs: int = 1, **params) -> list[RequestState]:
    """Requests with `computed` tokens in KV and one pending known token (prompt of computed + 1 - outputs)."""
    prompt_len = computed + 1 - outputs
    return [RequestState(f"r{i}", [3 + i] * prompt_len, [7 + i] * outputs, SamplingParams(**params),
                         block_ids=list(range(4 * i, 4 * i + 4)), num_computed_tokens=computed) for i in range(num)]


def _decode_step(states: list[RequestState]) -> SchedulerOutput:
    out = SchedulerOutput([s.req_id for s in states], [1] * len(states), [s.num_computed_tokens for s in states],
                          [[] for _ in states])
    out.is_decode_only = True
    return out


def _verify_step(states: list[RequestState], drafts: list[list[int]], scheduled=None) -> SchedulerOutput:
    return SchedulerOutput([s.req_id for s in states], scheduled or [1] * len(states),
                           [s.num_computed_tokens for s in states], drafts)


def _eager(flat) -> torch.Tensor:
    return RowModel()(flat.input_ids, flat.positions)


class TestChoosePath:
    """Every branch of the order: verify layout, full decode graphs (own size or the replicas'
    agreed one), piecewise graphs, eager."""

    @pytest.mark.parametrize(
        "step, sets, spans, agreed, expected",
        [
            # (verify_layout, decode_only, requests, tokens), (full?, piecewise?)
            ((True, True, 2, 6), (True, True), False, None, Choice(GraphPath.VERIFY)),
            ((True, False, 2, 6), (True, False), False, None, Choice(GraphPath.VERIFY)),
            ((False, True, 3, 3), (True, True), False, None, Choice(GraphPath.FULL)),
            ((False, True, 4, 4), (True, False), False, None, Choice(GraphPath.FULL)),
            ((False, True, 5, 5), (True, True), False, None, Choice(GraphPath.PIECEWISE)),  # past the full graphs
            ((False, True, 5, 5), (True, False), False, None, Choice(GraphPath.EAGER)),
            ((False, True, 3, 3), (False, True), False, None, Choice(GraphPath.PIECEWISE)),  # piecewise mode
            ((False, False, 3, 12), (True, True), False, None, Choice(GraphPath.PIECEWISE)),  # mixed step
            ((False, False, 3, 12), (True, False), False, None, Choice(GraphPath.EAGER)),
            ((False, False, 3, 17), (True, True), False, None, Choice(GraphPath.EAGER)),  # past the largest bucket
            ((False, True, 3, 3), (True, False), True, 4, Choice(GraphPath.AGREED, 4)),
            ((False, True, 1, 1), (True, False), True, 2, Choice(GraphPath.AGREED, 2)),
            ((False, True, 3, 3), (True, False), True, None, Choice(GraphPath.EAGER)),  # another replica is eager
            ((False, True, 5, 5), (True, False), True, None, Choice(GraphPath.EAGER)),
            ((False, True, 3, 3), (False, False), False, None, Choice(GraphPath.EAGER)),  # no graphs (CPU)
            ((False, False, 3, 12), (False, False), False, None, Choice(GraphPath.EAGER)),
        ])
    def test_path(self, step, sets, spans, agreed, expected):
        verify_layout, decode_only, requests, tokens = step
        full = _full() if sets[0] else None
        piecewise = _piecewise() if sets[1] else None
        assert choose_path(verify_layout=verify_layout, decode_only=decode_only, num_requests=requests,
                           num_tokens=tokens, full=full, piecewise=piecewise, spans_replicas=spans,
                           agreed_size=agreed) == expected


class TestGraphSets:
    @pytest.mark.parametrize("mode, spans, expected", [
        ("full_decode_only", False, GraphSets(full=True, piecewise=False)),
        ("piecewise", False, GraphSets(full=False, piecewise=True)),
        ("full_and_piecewise", False, GraphSets(full=True, piecewise=True)),
        ("full_decode_only", True, GraphSets(full=True, piecewise=False)),
        ("full_and_piecewise", True, GraphSets(full=True, piecewise=False)),  # replicas: agreed sizes only
    ])
    def test_sets_per_mode(self, mode, spans, expected):
        assert graph_sets(True, mode, spans) == expected

    @pytest.mark.parametrize("mode", ["full_decode_only", "piecewise", "full_and_piecewise"])
    def test_no_graphs_without_cuda_graphs(self, mode):
        assert graph_sets(False, mode, False) == GraphSets(full=False, piecewise=False)

    def test_verify_sizes_fit_the_largest_decode_graph_in_tokens(self):
        assert verify_graph_sizes((1, 2, 4, 8, 16), 4) == (1, 2, 4)
        assert verify_graph_sizes((1, 2), 3) == (1,)  # none fits: one request still gets a graph


class TestVerifyLayout:
    def _dispatcher(self, verify=True) -> GraphDispatcher:
        d = GraphDispatcher(RowModel(), MAX_LEN, BLOCK, CPU)
        d.verify = _full(sizes=(1, 2), query_len=3) if verify else None
        return d

    def test_decoding_requests_with_drafts_use_it(self):
        states = _states(2)
        assert self._dispatcher().uses_verify_layout(_verify_step(states, [[9, 9], [9]]), states)

    @pytest.mark.parametrize("case", ["no_verify_graphs", "no_drafts", "too_many_requests", "chunk",
                                      "pending_token_on_device", "past_max_model_len", "prompt_logprobs"])
    def test_other_steps_do_not(self, case):
        states = _states(3 if case == "too_many_requests" else 2, computed=30 if case == "past_max_model_len" else 5,
                         prompt_logprobs=1 if case == "prompt_logprobs" else None)
        drafts = [[], []] if case == "no_drafts" else [[9, 9] for _ in states]
        out = _verify_step(states, drafts, scheduled=[2, 1] if case == "chunk" else None)
        if case == "pending_token_on_device":
            states[0].output_token_ids.pop()
        assert not self._dispatcher(verify=case != "no_verify_graphs").uses_verify_layout(out, states)


@pytest.mark.usefixtures("eager_capture")
class TestCaptureAndForward:
    def _captured(self, num_draft_tokens=0, spans=False, sizes=(1, 2, 4)) -> GraphDispatcher:
        d = GraphDispatcher(RowModel(), MAX_LEN, BLOCK, CPU, spans_replicas=spans)
        d.capture_decode(sizes, num_draft_tokens, num_replicas=2)
        return d

    def test_capture_decode_adds_verify_graphs_in_the_same_pool_when_speculating(self):
        plain, spec = self._captured(), self._captured(num_draft_tokens=2, sizes=(1, 2, 4, 8))
        assert plain.verify is None and plain.full.sizes == (1, 2, 4)
        assert spec.verify.query_len == 3 and spec.verify.sizes == (1, 2) and spec.verify.pool == spec.full.pool
        assert spec.pool == spec.full.pool is not None

    def test_a_decode_step_replays_the_smallest_graph_that_holds_it(self, monkeypatch):
        d = self._captured()
        replays = []
        real = CUDAGraphRunner.replay
        monkeypatch.setattr(CUDAGraphRunner, "replay", lambda self, flat, inputs_only=False, size=None: (
            replays.append((flat.num_tokens, size)) or real(self, flat, inputs_only, size)))
        states = _states(3)
        out = _decode_step(states)
        flat = build_flat_batch(out, states, BLOCK, CPU)
        assert torch.equal(d.forward(flat, out), _eager(flat))
        assert replays == [(3, None)] and d.graph_batch_size(out) == 4
        wide = _states(5)  # past the largest graph: eager
        out = _decode_step(wide)
        flat = build_flat_batch(out, wide, BLOCK, CPU)
        assert torch.equal(d.forward(flat, out), _eager(flat)) and len(replays) == 1
        assert d.graph_batch_size(out) is None

    def test_replicas_replay_the_agreed_size_or_run_eagerly(self):
        d = self._captured(spans=True)
        states = _states(1)
        out = _decode_step(states)
        flat = build_flat_batch(out, states, BLOCK, CPU)
        with agreed_token_counts([4, 4], graph_size=4):
            assert d.choose(flat, out) == Choice(GraphPath.AGREED, 4) and d.graph_batch_size(out) == 4
            assert torch.equal(d.forward(flat, out), _eager(flat))
        assert d.model.calls[-1] == 4  # the graph of 4 ran, padded
        with agreed_token_counts([1, 9]):  # no agreed graph: another replica runs eagerly
            assert d.choose(flat, out) == Choice(GraphPath.EAGER) and d.graph_batch_size(out) is None
            calls = len(d.model.calls)
            assert torch.equal(d.forward(flat, out), _eager(flat)) and len(d.model.calls) == calls + 1

    def test_a_padded_verify_step_replays_the_verify_graphs(self):
        d = self._captured(num_draft_tokens=2, sizes=(1, 2, 4, 8))
        states = _states(2)
        out = _verify_step(states, [[9, 9], [9]])
        assert d.uses_verify_layout(out, states)
        flat = build_padded_verify_batch(out, states, d.verify.query_len, BLOCK, CPU)
        assert d.choose(flat, out) == Choice(GraphPath.VERIFY)
        assert torch.equal(d.forward(flat, out), _eager(flat))
        assert d.model.calls == [6]  # 2 requests x 3 rows

    def test_mixed_steps_replay_the_piecewise_graphs_in_the_decode_pool(self, monkeypatch):
        kits = []
        monkeypatch.setattr("atom_core.worker.piecewise.CudaGraphKit",
                            lambda device, pool: kits.append(pool) or RecordingGraphKit())
        d = self._captured()
        d.capture_piecewise((4, 8, 16), [])
        assert kits == [d.full.pool]
        states = _states(2)
        out = _verify_step(states, [[], []], scheduled=[3, 1])  # a chunk and a decode: 4 tokens
        states[0].num_computed_tokens = 3
        out.num_computed_tokens = [3, 5]
        flat = build_flat_batch(out, states, BLOCK, CPU)
        assert d.choose(flat, out) == Choice(GraphPath.PIECEWISE)
        replays = d.piecewise.kit.num_replays
        with torch.inference_mode():  # as the runner's launch (the capture ran under it too)
            hidden = d.forward(flat, out)
        assert torch.equal(hidden, _eager(flat)) and d.piecewise.kit.num_replays == replays + 1
        assert d.capture_seconds == d.full.capture_seconds + d.piecewise.capture_seconds

    def test_release_drops_every_graph_and_steps_run_eagerly(self):
        d = self._captured(num_draft_tokens=1)
        d.release()
        assert d.full is d.verify is d.piecewise is d.pool is None and d.capture_seconds == 0
        states = _states(2)
        out = _decode_step(states)
        flat = build_flat_batch(out, states, BLOCK, CPU)
        assert d.choose(flat, out) == Choice(GraphPath.EAGER) and torch.equal(d.forward(flat, out), _eager(flat))

    def test_an_idle_replica_replays_padding_or_runs_one_eager_token(self, monkeypatch):
        d = self._captured(spans=True)
        padding = []
        monkeypatch.setattr(CUDAGraphRunner, "replay_padding", lambda self, size: padding.append(size))
        with agreed_token_counts([2, 2], graph_size=2):
            d.forward_padding()
        assert padding == [2] and d.model.calls == []
        d.forward_padding()  # nothing agreed: one padding token, eagerly
        assert d.model.calls == [1] and padding == [2]

    def test_capture_forward_makes_graphs_of_another_forward_in_the_pool(self):
        d = self._captured()
        other = RowModel()
        graphs = d.capture_forward(other, (1, 2), MAX_LEN + 8, query_len=2)
        assert graphs.forward is other and graphs.sizes == (1, 2) and graphs.query_len == 2
        assert graphs.pool == d.pool and graphs.max_model_len == MAX_LEN + 8
