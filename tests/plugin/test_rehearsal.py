"""atom_core/plugin/rehearsal.py: before vLLM captures a graph, one layer of each KV spec runs our attention
eagerly on the capture's metadata (so Triton compiles the graph's kernel variants outside it), and stores
nothing into the cache whatever slots that metadata names."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from atom_core.loader import build_model
from atom_core.model_ops.forward_context import AttentionMetadata, get_attention_metadata
from atom_core.model_ops.kv_spec import allocate_kv_cache, attention_layers
from atom_core.plugin.rehearsal import rehearse_attention

BLOCK = 16


@pytest.fixture(scope="module", params=["qwen3", "deepseek_v2"])
def layers(request, tmp_path_factory):
    from tests.models.test_deepseek import build_tiny_deepseek
    from tests.tiny_models import build_tiny_model

    path = tmp_path_factory.mktemp(request.param)
    path = build_tiny_deepseek(path, "v2") if request.param == "deepseek_v2" else build_tiny_model(path, "qwen3")
    layers = attention_layers(build_model(AutoConfig.from_pretrained(str(path)), path, torch.float32, "cpu"))
    allocate_kv_cache(layers, 4, BLOCK, "cpu")
    for layer in layers:
        layer.k_cache.normal_()  # (MLA: the latent cache is both views)
        layer.v_cache.normal_()
    return layers


def capture_metadata() -> AttentionMetadata:
    """Two decode rows with real slots, sized for a long context (what our builder gives a capture)."""
    i32 = dict(dtype=torch.int32)
    return AttentionMetadata(query_start_loc=torch.tensor([0, 1, 2], **i32), seq_lens=torch.tensor([5, 20], **i32),
                             block_tables=torch.tensor([[0, 1], [2, 3]], **i32),
                             slot_mapping=torch.tensor([4, 2 * BLOCK + 3]), max_query_len=1, max_seq_len=512)


def test_one_layer_per_spec_runs_on_the_capture_batch_and_stores_nothing(layers):
    before = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in layers]
    seen = []

    class Recording:  # the layer's own backend, and what it saw
        def __init__(self, inner):
            self.inner = inner

        def forward(self, layer, *inputs):
            meta = get_attention_metadata()
            seen.append((layer, meta.max_seq_len, meta.slot_mapping.tolist(), inputs[0].shape[0]))
            out = self.inner.forward(layer, *inputs)
            assert out.shape[0] == 2 and torch.isfinite(out).all()
            return out

    count = rehearse_attention(layers, capture_metadata(), lambda layer: Recording(layer.backend(torch.device("cpu"))))
    assert count == len({layer.kv_spec for layer in layers}) == 1
    assert [(s[0], s[1:]) for s in seen] == [(layers[0], (512, [-1, -1], 2))]
    for layer, (k, v) in zip(layers, before):
        assert torch.equal(layer.k_cache, k) and torch.equal(layer.v_cache, v)
