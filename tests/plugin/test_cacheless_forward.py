"""vLLM on CUDA runs a memory-profiling forward before it allocates any KV cache (plugin mode's backend
answers it: plugin/attention.py): a layer runs without a cache only when its backend says it may
(`needs_allocated_cache`), and otherwise still refuses, naming the missed allocation."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from atom_core.model_ops.kv_spec import attention_layers
from atom_core.models.registry import resolve_model_class


class CachelessBackend:
    """What plugin mode's backend does in vLLM's profiling forward: no metadata, no cache, zeros out."""

    needs_allocated_cache = False

    def __init__(self):
        self.calls = 0

    def forward(self, layer, first, *args):
        self.calls += 1
        width = layer.num_heads * (layer.v_head_dim if layer.kv_spec.kind == "mla" else layer.head_dim)
        return first.new_zeros(first.shape[0], width)


@pytest.fixture(scope="module", params=["qwen3", "deepseek_v2"])
def model(request, tmp_path_factory):
    from tests.models.test_deepseek import build_tiny_deepseek
    from tests.tiny_models import build_tiny_model

    path = tmp_path_factory.mktemp(request.param)
    path = build_tiny_deepseek(path, "v2") if request.param == "deepseek_v2" else build_tiny_model(path, "qwen3")
    config = AutoConfig.from_pretrained(str(path))
    return resolve_model_class(config)(config).eval()


@torch.inference_mode()
def test_only_a_backend_that_allows_it_runs_a_layer_without_its_cache(model):
    ids, positions = torch.tensor([3, 4, 5]), torch.arange(3)
    with pytest.raises(AssertionError, match="KV cache not allocated"):
        model(ids, positions)  # the default backends need the cache: a missed allocation is named
    backend = CachelessBackend()
    layers = attention_layers(model)
    for layer in layers:
        layer._backend = backend
    hidden = model(ids, positions)
    assert hidden.shape == (3, model.config.hidden_size) and backend.calls == len(layers)
