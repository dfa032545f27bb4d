"""atom_core/plugin/padded_rows.py: vLLM pads a step's rows to a CUDA-graph size past the tokens its
metadata covers; our attention runs on the real rows (same output, same cache writes as an unpadded
step) and the padding rows get zeros."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from atom_core.loader import build_model
from atom_core.model_ops.forward_context import AttentionMetadata, set_attention_metadata
from atom_core.model_ops.kv_spec import allocate_kv_cache, attention_layers
from atom_core.plugin.padded_rows import attend_real_rows

BLOCK, REAL, PAD = 16, 3, 5


@pytest.fixture(scope="module", params=["qwen3", "deepseek_v2"])
def model(request, tmp_path_factory):
    from tests.models.test_deepseek import build_tiny_deepseek
    from tests.tiny_models import build_tiny_model

    path = tmp_path_factory.mktemp(request.param)
    path = build_tiny_deepseek(path, "v2") if request.param == "deepseek_v2" else build_tiny_model(path, "qwen3")
    model = build_model(AutoConfig.from_pretrained(str(path)), path, torch.float32, "cpu").eval()
    allocate_kv_cache(attention_layers(model), 2, BLOCK, "cpu")
    return model


def prefill_metadata() -> AttentionMetadata:
    """One fresh prompt of REAL tokens in block 1 (vLLM's metadata: real tokens only)."""
    i32 = dict(dtype=torch.int32)
    return AttentionMetadata(query_start_loc=torch.tensor([0, REAL], **i32), seq_lens=torch.tensor([REAL], **i32),
                             block_tables=torch.tensor([[1]], **i32), slot_mapping=torch.arange(REAL) + BLOCK,
                             max_query_len=REAL, max_seq_len=REAL)


class Padded:
    """Each layer's own backend behind attend_real_rows, as plugin mode's backend calls it."""

    def __init__(self, inner):
        self.inner = inner

    def forward(self, layer, first, *args):
        from atom_core.model_ops.forward_context import get_attention_metadata

        return attend_real_rows(self.inner, layer, get_attention_metadata(), first, *args)


def caches(model):
    return [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in attention_layers(model)]


@torch.inference_mode()
def test_a_padded_step_attends_its_real_rows_and_zeros_the_padding(model):
    ids = torch.tensor([5, 9, 2])
    for layer in attention_layers(model):
        layer.k_cache.zero_(), layer.v_cache.zero_()
    with set_attention_metadata(prefill_metadata()):
        want = model(ids, torch.arange(REAL))
    want_cache = caches(model)
    layers = attention_layers(model)
    for layer in layers:
        layer.k_cache.zero_(), layer.v_cache.zero_()
        layer._backend = Padded(layer.backend(torch.device("cpu")))
    try:
        padded_ids = torch.cat([ids, torch.zeros(PAD - REAL, dtype=ids.dtype)])  # vLLM pads ids and positions
        with set_attention_metadata(prefill_metadata()):
            got = model(padded_ids, torch.cat([torch.arange(REAL), torch.zeros(PAD - REAL, dtype=torch.int64)]))
    finally:
        for layer in layers:
            layer._backend = None
    assert got.shape[0] == PAD
    torch.testing.assert_close(got[:REAL], want, rtol=1e-5, atol=1e-5)
    for (k, v), (wk, wv) in zip(caches(model), want_cache):  # (float32 sums over 5 rows, not 3: close)
        torch.testing.assert_close(k, wk, rtol=1e-5, atol=1e-5)  # the padding rows stored nothing
        torch.testing.assert_close(v, wv, rtol=1e-5, atol=1e-5)


def test_metadata_longer_than_the_rows_is_refused(model):
    layer = attention_layers(model)[0]
    with pytest.raises(ValueError, match="metadata for 3 tokens but 2 token rows"):
        attend_real_rows(None, layer, prefill_metadata(), torch.zeros(2, 8))
