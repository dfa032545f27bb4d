"""Piecewise graphs (worker/piecewise.py) on the CPU: the bucket ladder and padding, and engine
steps through the real runner with a recording stand-in for CUDA graphs (graph_recorder.py),
compared with the same steps run eagerly.

CPU GEMMs give a row slightly different bits when the row count changes (MKL blocks by rows:
4.8e-6 apart for a 64x96 linear at 1 vs 8 rows), so a step whose token count is a bucket must
equal the eager step bit for bit, and a padded step within 1e-5 (float32), with the same tokens.
"""
from __future__ import annotations

import pytest
import torch

from atom_core import LLMEngine, SamplingParams
from atom_core.config import EngineConfig
from atom_core.model_ops.forward_context import set_attention_metadata
from atom_core.worker.graph_sizes import padded_size
from atom_core.worker.piecewise import AttentionCall, PiecewiseGraphRunner
from tests.worker.graph_recorder import RecordingGraphKit

SIZES = (1, 2, 4, 8, 16, 24)


class TestBuckets:
    def test_smallest_bucket_that_fits(self):
        assert [padded_size(SIZES, n) for n in (1, 3, 8, 9, 24)] == [1, 4, 8, 16, 24]

    def test_over_the_largest_bucket_is_none(self):
        assert padded_size(SIZES, 25) is None

    def test_default_ladder_is_capped_by_the_token_budget(self):
        cfg = EngineConfig.from_kwargs("m", max_num_batched_tokens=100, cudagraph_mode="piecewise")
        assert cfg.piecewise_sizes == (1, 2, 4, *range(8, 97, 8), 100)
        full = EngineConfig.from_kwargs("m", cudagraph_mode="piecewise").piecewise_sizes
        assert full[:4] == (1, 2, 4, 8) and full[-3:] == (480, 496, 512) and len(full) == 3 + 31 + 17

    def test_given_sizes_are_sorted_deduplicated_and_capped(self):
        cfg = EngineConfig.from_kwargs("m", max_num_batched_tokens=64, cudagraph_mode="full_and_piecewise",
                                       piecewise_capture_sizes=[32, 8, 8, 128, 1])
        assert cfg.piecewise_sizes == (1, 8, 32)


def _engine(path, **kw) -> LLMEngine:
    return LLMEngine(str(path), device="cpu", dtype="float32", max_num_batched_tokens=32, num_kv_blocks=64,
                     async_scheduling=False, num_scheduler_steps=1, **kw)


def _record_forwards(engine: LLMEngine) -> list:
    """(num_tokens, decode_only, path, hidden, eager_hidden) of every forward the runner makes from
    now on. eager_hidden: the same step run eagerly first, on the same KV cache contents (its KV
    writes are then overwritten by the step itself), so every step compares from equal state."""
    runner = engine.core.executor.runner
    steps, forward = [], runner._forward

    def recording(flat, out, inputs_only=False):
        pw, full = runner.dispatcher.piecewise, runner.dispatcher.full
        path, eager = "eager", None
        if full is not None and out.is_decode_only and full.can_run(len(out)):
            path = "full"
        elif pw is not None and pw.can_run(flat.num_tokens):
            path = "exact" if pw.padded_size(flat.num_tokens) == flat.num_tokens else "padded"
            with set_attention_metadata(flat.attn):
                eager = runner.model(flat.input_ids, flat.positions).clone()
        hidden = forward(flat, out, inputs_only)
        steps.append((flat.num_tokens, out.is_decode_only, path, hidden.clone(), eager))
        return hidden

    runner._forward = recording
    return steps


# Requests arriving while others decode (32-token budget): steps over the largest bucket (eager),
# mixed prefill-chunk + decode steps of padded and exact bucket sizes, and one-token decodes.
ARRIVALS = {0: [(5, 12), (19, 8)], 2: [(40, 5)], 4: [(5, 9)], 5: [(2, 2)], 7: [(13, 6)], 9: [(3, 4)],
            18: [(1, 4)]}


def _run(engine: LLMEngine, arrivals: dict = ARRIVALS, vocab: int = 290) -> tuple[dict, list]:
    """Requests {step: [(prompt length, max tokens)]} added at those steps; greedy tokens per
    request id and the recorded forwards."""
    steps = _record_forwards(engine)
    outputs = {}

    def keep(state, ids, text):
        outputs[state["request_id"]] = state["token_ids"]

    for i in range(10_000):
        for length, max_tokens in arrivals.get(i, []):
            prompt = [3 + (7 * length + j) % vocab for j in range(length)]
            engine.add_request([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                               stream_callback=keep)
        if engine.is_finished() and i > max(arrivals):
            break
        engine.step()
    assert sum(len(v) for v in outputs.values()) == sum(m for reqs in arrivals.values() for _, m in reqs)
    return outputs, steps


@pytest.fixture(scope="module")
def eager_run(tiny_llama):
    return _run(_engine(tiny_llama))


def _piecewise_engine(path, kit) -> LLMEngine:
    engine = _engine(path)
    runner = engine.core.executor.runner
    runner.config = runner.config.replace(cudagraph_mode="full_and_piecewise", piecewise_capture_sizes=SIZES)
    runner.dispatcher.capture_piecewise(runner.config.piecewise_sizes, runner.attention_layers, kit)
    return engine


class TestEngineSteps:
    def test_mixed_steps_equal_eager(self, tiny_llama, eager_run):
        kit = RecordingGraphKit()
        engine = _piecewise_engine(tiny_llama, kit)
        outputs, steps = _run(engine)
        eager_outputs, eager_steps = eager_run
        assert outputs == eager_outputs  # greedy tokens of the whole run
        assert [s[:2] for s in steps] == [s[:2] for s in eager_steps]
        kinds = {(decode_only, path) for _, decode_only, path, *_ in steps}
        assert {(False, "exact"), (False, "padded"), (False, "eager"), (True, "exact"), (True, "padded")} <= kinds, \
            [s[:3] for s in steps]
        assert sum(n == 1 for n, _, path, *_ in steps if path == "exact") >= 3  # a 1-token prefill, then decodes
        assert any(n == SIZES[-1] for n, *_ in steps)  # the largest bucket, full
        for n, _, path, hidden, eager in steps:
            if path == "padded":
                torch.testing.assert_close(hidden, eager, rtol=0, atol=1e-5)
            elif path == "exact":
                assert torch.equal(hidden, eager), n
        graphs_per_bucket = len(engine.core.executor.runner.attention_layers) + 1
        assert len(kit.graphs) == len(SIZES) * graphs_per_bucket
        assert kit.num_replays == graphs_per_bucket * sum(path != "eager" for _, _, path, *_ in steps)
        assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks

    def test_padded_rows_store_no_kv_and_reach_no_attention(self, tiny_llama):
        """A 3-token prefill replays bucket 4: 3 KV slots written per layer, and attention writes
        only the 3 real rows of its static output (the padded row keeps what it held)."""
        engine = _piecewise_engine(tiny_llama, RecordingGraphKit())
        runner = engine.core.executor.runner
        output = runner.dispatcher.piecewise.plans[4].calls[-1].output
        with torch.inference_mode():
            output[3].fill_(7.0)
        before = [layer.k_cache.clone() for layer in runner.attention_layers]
        engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=1))
        for layer, old in zip(runner.attention_layers, before):
            changed = (layer.k_cache != old).flatten(2).any(-1)  # [blocks, block_size]
            assert int(changed.sum()) == 3
        assert bool((output[3] == 7.0).all()) and not bool((output[:3] == 7.0).any())

    def test_replay_reads_the_captured_input_buffers(self, tiny_llama):
        """The stand-in replays on captured memory: inputs written elsewhere are not seen."""
        engine = _piecewise_engine(tiny_llama, RecordingGraphKit())
        runner = engine.core.executor.runner
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        good = engine.generate([[5, 6, 7]], params)[0]["token_ids"]
        piecewise = runner.dispatcher.piecewise
        piecewise.input_ids = torch.zeros_like(piecewise.input_ids)  # no longer the captured one
        assert engine.generate([[5, 6, 7]], params)[0]["token_ids"] != good


def _generate(engine: LLMEngine, prompts, max_tokens: int) -> list:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o["token_ids"] for o in engine.generate(prompts, params)]


REPETITIVE = [[5, 6, 7, 8] * 6, [9, 10, 11] * 3 + [12], [13]]


class TestOtherStepProducers:
    """Steps that are not one forward of known tokens also run in the piecewise graphs."""

    @pytest.mark.parametrize("options", [dict(method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3),
                                         dict(num_scheduler_steps=4)], ids=["ngram_verify", "multi_step_window"])
    def test_same_tokens_as_eager(self, tiny_llama, options):
        kw = dict(device="cpu", dtype="float32", max_num_batched_tokens=32, num_kv_blocks=64, **options)
        expected = _generate(LLMEngine(str(tiny_llama), **kw), REPETITIVE, 12)
        engine = LLMEngine(str(tiny_llama), **kw)
        runner = engine.core.executor.runner
        runner.config = runner.config.replace(cudagraph_mode="piecewise", piecewise_capture_sizes=SIZES)
        kit = RecordingGraphKit()
        runner.dispatcher.capture_piecewise(runner.config.piecewise_sizes, runner.attention_layers, kit)
        assert _generate(engine, REPETITIVE, 12) == expected
        assert kit.num_replays > 0
        if "method" in options:
            assert engine.spec_decode_stats()["num_accepted_tokens"] > 0


class _CountingKit(RecordingGraphKit):
    """Notes begin/end only: the recording stand-in's dispatch mode would keep Dynamo's compiled
    layers from running (and cannot replay Inductor's C++ kernels)."""

    def __init__(self):
        super().__init__()
        self.events = []

    def new_graph(self):
        events = self.events

        class Graph:
            def begin(self):
                events.append("begin")

            def end(self):
                events.append("end")

        return Graph()


class TestCapture:
    def test_compiled_layers_split_at_the_attention_op(self, tiny_qwen3):
        """At level 3 the layers are Inductor graphs with attention as atom::paged_attention;
        its implementation reaches the capture's stand-in backend, one call per layer (capture only)."""
        from atom_core.worker.compile import compile_model

        from torch._dynamo.utils import counters

        engine = LLMEngine(str(tiny_qwen3), device="cpu", dtype="float32", num_kv_blocks=64)
        runner = engine.core.executor.runner
        torch._dynamo.reset()
        counters.clear()
        compile_model(runner.model)
        kit = _CountingKit()
        pw = PiecewiseGraphRunner(runner.model, runner.attention_layers, (1, 8), runner.device, kit)
        pw.capture_all()
        assert counters["stats"]["unique_graphs"] == 4  # (first layer, the others) x (1 token, many): compiled
        assert kit.events == ["begin", "end"] * (len(runner.attention_layers) + 1) * 2
        layer = runner.attention_layers[0]
        for T, plan in pw.plans.items():
            assert len(plan.calls) == len(runner.attention_layers) and len(plan.graphs) == len(plan.calls) + 1
            assert [c.layer for c in plan.calls] == runner.attention_layers
            assert all(c.output.shape == (T, layer.num_heads * layer.head_dim) for c in plan.calls)
            assert all(c.inputs[1].data_ptr() == pw.positions.data_ptr() for c in plan.calls)  # read in place
        assert all(layer._backend is None or type(layer._backend).__name__ != "_Substitute"
                   for layer in runner.attention_layers)  # the layers' own backends are back

    def test_a_host_sync_inside_a_piece_fails_the_capture(self, tmp_path):
        """The CPU MoE reference gathers tokens per expert with nonzero(): not capturable (the
        GPU path uses the Triton MoE kernels, as the decode graphs do)."""
        from tests.tiny_models import build_tiny_model

        engine = LLMEngine(str(build_tiny_model(tmp_path, "qwen3_moe")), device="cpu", num_kv_blocks=64)
        runner = engine.core.executor.runner
        pw = PiecewiseGraphRunner(runner.model, runner.attention_layers, (4,), runner.device, RecordingGraphKit())
        with pytest.raises(AssertionError, match="syncs the host"):
            pw.capture_all()


class _RowSum:
    """A stand-in backend: each output row is its input row's sum, written into `out` when it takes one."""

    def __init__(self, writes_out: bool):
        self.writes_out, self.outs = writes_out, []

    def forward(self, layer, x, out=None):
        self.outs.append(out)
        result = x.sum(-1, keepdim=True).expand(-1, 2)
        if out is None:
            return result.clone()
        out.copy_(result)
        return out


class TestAttentionCallOutput:
    """The eager attention's result lands in rows [:n] of the static output buffer: written there
    by backends that take `out` (no copy after them), copied there from the others."""

    @pytest.mark.parametrize("writes_out", [True, False])
    def test_rows_written_and_padding_kept(self, writes_out):
        backend = _RowSum(writes_out)
        inputs = [torch.arange(12.0).view(4, 3)]
        output = torch.full((4, 2), -1.0)
        AttentionCall(backend, None, inputs, output).run(3)
        assert torch.equal(output[:3], torch.tensor([[3.0] * 2, [12.0] * 2, [21.0] * 2]))
        assert bool((output[3] == -1.0).all())  # a padded row is not touched
        out = backend.outs[0]
        if writes_out:  # the backend got the static buffer's rows themselves
            assert out.data_ptr() == output.data_ptr() and out.shape == (3, 2)
        else:
            assert out is None

    def test_paged_backend_writes_into_the_static_output(self, tiny_llama):
        """The paged MHA backend takes `out`: every captured call of a piecewise engine runs that way."""
        engine = _piecewise_engine(tiny_llama, RecordingGraphKit())
        calls = engine.core.executor.runner.dispatcher.piecewise.plans[SIZES[-1]].calls
        assert calls and all(call.backend.writes_out for call in calls)


class TestModeOnTheCPU:
    def test_piecewise_mode_is_a_no_op_on_the_cpu(self, tiny_llama):
        """As every graph level: the CPU runs eagerly (CompileConfig's doc); no graphs are made."""
        engine = LLMEngine(str(tiny_llama), device="cpu", num_kv_blocks=64, cudagraph_mode="full_and_piecewise")
        runner = engine.core.executor.runner
        assert runner.dispatcher.piecewise is None and runner.dispatcher.full is None
        assert len(_generate(engine, [[5, 6, 7]], 3)[0]) == 3


class TestRunnerWiring:
    """Which graphs ModelRunner builds per mode (on a GPU; here with stand-ins for both kinds)."""

    @pytest.mark.parametrize("mode", ["full_decode_only", "piecewise", "full_and_piecewise"])
    def test_graphs_built_per_mode(self, tiny_llama, monkeypatch, mode):
        kits = []

        class FakeDecodeGraphs:
            pool = "decode-pool"

            def __init__(self, *args, **kwargs):
                self.capture_seconds = 0.0

            def capture_all(self):
                pass

            def can_run(self, batch_size):
                return False  # decode-only steps fall through to the piecewise graphs here

        def kit(device, pool):
            kits.append(pool)
            return RecordingGraphKit()

        monkeypatch.setattr(EngineConfig, "use_cuda_graphs", property(lambda self: True))
        monkeypatch.setattr("atom_core.worker.cuda_graph.CUDAGraphRunner", FakeDecodeGraphs)
        monkeypatch.setattr("atom_core.worker.piecewise.CudaGraphKit", kit)
        engine = LLMEngine(str(tiny_llama), device="cpu", dtype="float32", num_kv_blocks=64, cudagraph_mode=mode,
                           max_num_batched_tokens=16)
        runner = engine.core.executor.runner
        assert (runner.dispatcher.full is not None) == (mode != "piecewise")
        assert (runner.dispatcher.piecewise is not None) == (mode != "full_decode_only")
        assert kits == {"full_decode_only": [], "piecewise": [None], "full_and_piecewise": ["decode-pool"]}[mode]
        if runner.dispatcher.piecewise is not None:
            assert runner.dispatcher.piecewise.sizes == (1, 2, 4, 8, 16)  # the default ladder capped at the budget
            assert runner.startup_breakdown["graph_capture"] == runner.dispatcher.piecewise.capture_seconds > 0
            assert len(_generate(engine, [[5, 6, 7, 8, 9]], 4)[0]) == 4
