"""atom_core/plugin/prefill_graphs.py on the CPU, with the recording stand-in for CUDA graphs
(tests/worker/graph_recorder.py): a step vLLM runs eagerly replays our piecewise graphs, padded
rows included (vLLM's padding comes back as zeros), with the same hidden states and KV writes as
the eager forward; steps the graphs cannot serve are left to the eager forward (None)."""
from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoConfig

from atom_core.loader import build_model
from atom_core.model_ops.forward_context import AttentionMetadata, set_attention_metadata
from atom_core.model_ops.kv_spec import allocate_kv_cache, attention_layers
from atom_core.plugin.prefill_graphs import PrefillGraphs
from tests.worker.graph_recorder import RecordingGraphKit

BLOCK, BUDGET = 16, 8  # the largest bucket: a step of up to 8 tokens replays


@pytest.fixture(scope="module", params=["qwen3", "deepseek_v2"])
def model(request, tmp_path_factory):
    from tests.models.test_deepseek import build_tiny_deepseek
    from tests.tiny_models import build_tiny_model

    path = tmp_path_factory.mktemp(request.param)
    # DeepSeek-V2 all dense (MLA without the MoE layers, whose CPU reference syncs the host: not capturable)
    path = build_tiny_deepseek(path, "v2", first_k_dense_replace=3) if request.param == "deepseek_v2" \
        else build_tiny_model(path, "qwen3")
    model = build_model(AutoConfig.from_pretrained(str(path)), path, torch.float32, "cpu").eval()
    allocate_kv_cache(attention_layers(model), 4, BLOCK, "cpu")
    return model


def metadata(prompts: list[tuple[int, int]]) -> AttentionMetadata:
    """Fresh prompts [(block, length)]: one block each, their tokens only (as vLLM builds it)."""
    i32 = dict(dtype=torch.int32)
    lens = [n for _, n in prompts]
    starts = torch.tensor([0] + lens, **i32).cumsum(0, dtype=torch.int32)
    slots = torch.cat([torch.arange(n) + block * BLOCK for block, n in prompts])
    return AttentionMetadata(query_start_loc=starts, seq_lens=torch.tensor(lens, **i32),
                             block_tables=torch.tensor([[b] for b, _ in prompts], **i32), slot_mapping=slots,
                             max_query_len=max(lens), max_seq_len=max(lens))


def caches(model):
    return [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in attention_layers(model)]


def zero_caches(model):
    for layer in attention_layers(model):
        layer.k_cache.zero_(), layer.v_cache.zero_()


@pytest.fixture(scope="module")
def graphs(model):
    current = {}
    graphs = PrefillGraphs(functools.partial(type(model).forward, model), attention_layers(model), BUDGET,
                           torch.device("cpu"), lambda: current.get("metadata"), kit=RecordingGraphKit())
    graphs.current = current
    with torch.inference_mode():
        assert graphs.run(torch.zeros(3, dtype=torch.int64), torch.arange(3)) is None  # not captured yet
        zero_caches(model)
        graphs.capture()
        graphs.capture()  # once
    assert graphs.runner.sizes == (1, 2, 4, 8) and graphs.kit.num_replays == 0
    assert not any(layer.k_cache.any() for layer in attention_layers(model))  # the capture stored nothing
    return graphs


@pytest.mark.parametrize("prompts, rows", [([(1, 3)], 5), ([(1, 4)], 4), ([(0, 2), (2, 5)], 8)])
@torch.inference_mode()
def test_a_step_replays_the_graphs_and_equals_the_eager_forward(model, graphs, prompts, rows):
    real = sum(n for _, n in prompts)
    ids = torch.randint(1, 50, (rows,))
    positions = torch.cat([torch.arange(n) for _, n in prompts] + [torch.zeros(rows - real, dtype=torch.int64)])
    meta = metadata(prompts)
    zero_caches(model)
    with set_attention_metadata(meta):
        want = model(ids[:real], positions[:real]).clone()
    want_cache = caches(model)
    zero_caches(model)
    replays = graphs.kit.num_replays
    graphs.current["metadata"] = meta
    got = graphs.run(ids, positions)
    assert graphs.kit.num_replays > replays and got.shape == (rows, want.shape[1])
    torch.testing.assert_close(got[:real], want, rtol=1e-5, atol=1e-5)
    assert not got[real:].any()  # vLLM's padding rows
    for (k, v), (wk, wv) in zip(caches(model), want_cache):
        torch.testing.assert_close(k, wk, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, wv, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_steps_the_graphs_do_not_serve_run_eagerly(model, graphs):
    replays = graphs.kit.num_replays
    graphs.current["metadata"] = None  # vLLM's memory-profiling forward
    assert graphs.run(torch.zeros(4, dtype=torch.int64), torch.arange(4)) is None
    graphs.current["metadata"] = metadata([(0, 9)])  # over the largest bucket
    assert graphs.run(torch.zeros(9, dtype=torch.int64), torch.arange(9)) is None
    assert graphs.run(torch.zeros(3, dtype=torch.int64), torch.zeros(3, 3, dtype=torch.int64)) is None  # MRoPE rows
    assert graphs.kit.num_replays == replays
    graphs.current["metadata"] = metadata([(0, 3)])
    with pytest.raises(ValueError, match="metadata for 3 tokens but 2 token rows"):
        graphs.run(torch.zeros(2, dtype=torch.int64), torch.arange(2))


@pytest.mark.parametrize("budget, largest", [(8192, 2048), (2048, 2048), (1000, 1000), (8, 8)])
def test_the_buckets_are_atomctl_serves_up_to_the_budget(budget, largest):
    """vLLM's loaded steps mix a prompt's chunk with the decodes, as our server's: the same ladder."""
    from atom_core.config import SERVE_PIECEWISE_SIZES

    sizes = PrefillGraphs(lambda *a: None, [], budget, torch.device("cpu"), lambda: None).sizes
    assert sizes[-1] == largest and list(sizes) == sorted(set(sizes))
    assert set(sizes) - {budget} <= set(SERVE_PIECEWISE_SIZES)
    assert [s for s in SERVE_PIECEWISE_SIZES if s < budget] == [s for s in sizes if s < budget]
