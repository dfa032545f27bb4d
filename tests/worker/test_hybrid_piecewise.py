"""Hybrid linear-attention models under torch.compile and piecewise graphs: a gated DeltaNet's core (conv,
delta rule, gated norm: the part that reads the step's metadata and the state pools) is the opaque op
atom::gated_delta_net, so the compiled layers split there as at attention, and the piecewise runner
replays the pieces around it with the core run eagerly on the step's exact metadata."""
from __future__ import annotations

import pytest
import torch

from atom_core import LLMEngine, SamplingParams
from atom_core.model_ops.linear_attention import DeltaNetCore, GatedDeltaNet
from atom_core.worker.piecewise import PiecewiseGraphRunner
from tests.tiny_models import build_tiny_model
from tests.worker.graph_recorder import RecordingGraphKit
from tests.worker.test_piecewise import _CountingKit

SIZES = (1, 4, 16)
# Prefill chunks of a 32-token budget beside decodes, prompts past the delta rule's 64-token chunk.
PROMPTS = [list(range(3, 80)), [5, 6, 7], list(range(40, 60))]
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_qwen3_5(tmp_path_factory):
    """Dense MLPs: the CPU MoE reference's nonzero() syncs the host, which no graph capture allows."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_5_pw"), "qwen3_5")


def _engine(path) -> LLMEngine:
    return LLMEngine(str(path), device="cpu", dtype="float32", max_num_batched_tokens=32, num_kv_blocks=64,
                     async_scheduling=False, num_scheduler_steps=1)


def _tokens(engine: LLMEngine) -> list[list[int]]:
    return [o["token_ids"] for o in engine.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def eager_tokens(tiny_qwen3_5):
    return _tokens(_engine(tiny_qwen3_5))


def _split_layers(runner) -> list:
    return runner.attention_layers + runner.state_layers


def test_the_core_op_and_its_fake_agree():
    """torch.library.opcheck: the schema holds and the fake (what compile traces) gives the real op's
    shape and dtype, on a prefill of two sequences."""
    from transformers import Qwen3_5TextConfig

    from atom_core.model_ops.forward_context import AttentionMetadata, set_attention_metadata
    from atom_core.model_ops.kv_spec import allocate_state_cache
    from atom_core.models.qwen3_5 import Qwen3_5GatedDeltaNet

    config = Qwen3_5TextConfig(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=8, linear_value_head_dim=8, num_hidden_layers=1)
    layer = Qwen3_5GatedDeltaNet(config, "model.layers.0.linear_attn", None)
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0, 0.3)
    allocate_state_cache([layer], 2, "cpu")
    mixed_qkv, z, b, a = layer.project(torch.randn(7, 32))
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    meta = AttentionMetadata(i32([0, 4, 7]), i32([4, 3]), torch.zeros(2, 1, dtype=torch.int32),
                             torch.arange(7), 4, 4, state_slots=i32([1, 2]))
    with set_attention_metadata(meta):
        torch.library.opcheck(torch.ops.atom.gated_delta_net.default, (mixed_qkv, z, b, a, layer.layer_key),
                              test_utils=("test_schema", "test_faketensor"))
        out = torch.ops.atom.gated_delta_net(mixed_qkv, z, b, a, layer.layer_key)
    assert out.shape == (7, layer.value_dim) and torch.isfinite(out).all()


@pytest.mark.xfail(strict=True, reason="the DeltaNet cores' inputs and outputs equal eager's, but the tokens diverge "
                   "from the gated full-attention layer's pieces on (a Qwen3.5 config of full layers only diverges "
                   "too); the runner keeps piecewise graphs off for hybrid models until this passes")
def test_piecewise_steps_equal_eager(tiny_qwen3_5, eager_tokens):
    engine = _engine(tiny_qwen3_5)
    runner = engine.core.executor.runner
    layers = _split_layers(runner)
    assert len(runner.state_layers) == 3 and all(isinstance(m, GatedDeltaNet) for m in runner.state_layers)
    kit = RecordingGraphKit()
    runner.config = runner.config.replace(cudagraph_mode="piecewise", piecewise_capture_sizes=SIZES)
    runner.dispatcher.capture_piecewise(runner.config.piecewise_sizes, layers, kit)
    plan = runner.dispatcher.piecewise.plans[SIZES[-1]]
    # One piece boundary per layer, in the model's order: three DeltaNet cores, then attention.
    assert [call.layer for call in plan.calls] == [layer.linear_attn if hasattr(layer, "linear_attn")
                                                   else layer.self_attn.attn for layer in runner.model.model.layers]
    assert isinstance(plan.calls[0].backend, DeltaNetCore)
    assert len(kit.graphs) == len(SIZES) * (len(layers) + 1)
    assert _tokens(engine) == eager_tokens
    assert kit.num_replays > 0
    assert all(layer._backend is None or isinstance(layer._backend, DeltaNetCore) for layer in runner.state_layers)
    kv = engine.core.kv
    assert kv.num_free_blocks == kv.num_blocks and kv.num_free_state_slots == kv.num_state_slots


def test_compiled_layers_equal_eager_and_split_at_the_core(tiny_qwen3_5, eager_tokens):
    """compile_model (levels 2/3): fullgraph per decoder layer with the core as atom::gated_delta_net; the
    compiled engine's tokens equal eager, and a piecewise capture of the compiled layers reaches the
    capture's stand-in once per DeltaNet core and once per attention layer."""
    from atom_core.worker.compile import compile_model

    engine = _engine(tiny_qwen3_5)
    runner = engine.core.executor.runner
    torch._dynamo.reset()
    compile_model(runner.model)
    assert all(m.use_custom_op for m in runner.state_layers)
    assert _tokens(engine) == eager_tokens
    kit = _CountingKit()
    layers = _split_layers(runner)
    pw = PiecewiseGraphRunner(runner.model, layers, (1, 8), runner.device, kit)
    pw.capture_all()
    assert kit.events == ["begin", "end"] * (len(layers) + 1) * 2
    for T, plan in pw.plans.items():
        cores = [c for c in plan.calls if isinstance(c.layer, GatedDeltaNet)]
        assert len(cores) == len(runner.state_layers)
        assert all(c.output.shape == (T, c.layer.value_dim) for c in cores)
