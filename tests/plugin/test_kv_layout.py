"""The version-dependent part of plugin mode that needs no vLLM (atom_core/plugin/kv_layout.py): which
layout a vLLM binds each layer's cache in, and our K/V views of it, checked element by element against
how that vLLM's own attention reads the same tensor (0.20: FlashAttention's `kv_cache.unbind(0)` on
[2, NB, BS, KH, D]; 0.32: K and V side by side in the last dim of the logical [B, H, N, 2D] page)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from atom_core.plugin import kv_layout

NB, BS, KH, D = 3, 4, 2, 8


def test_the_layout_follows_what_the_vllm_module_defines():
    assert kv_layout.layout_of(SimpleNamespace(compute_layer_kv_cache_shape_bytes=lambda: None)) == "logical_pages"
    assert kv_layout.layout_of(SimpleNamespace(FullAttentionSpec=object)) == "planes"


def test_planes_shapes_are_flash_attentions_and_the_latent_row():
    assert kv_layout.kv_cache_shape("mha", NB, BS, KH, D) == (2, NB, BS, KH, D)
    assert kv_layout.kv_cache_shape("mla", NB, BS, 1, 576) == (NB, BS, 1, 576)
    with pytest.raises(ValueError, match="one latent row per token, not 2 KV heads"):
        kv_layout.kv_cache_shape("mla", NB, BS, 2, 576)


def test_planes_views_are_the_k_and_v_planes_in_place():
    cache = torch.arange(2 * NB * BS * KH * D, dtype=torch.float32).view(kv_layout.kv_cache_shape("mha", NB, BS, KH, D))
    k, v = kv_layout.attention_views(cache, "mha", "planes")
    key_cache, value_cache = cache.unbind(0)  # how vLLM 0.20's FlashAttention reads the layer's cache
    assert k.shape == v.shape == (NB, BS, KH, D)
    assert torch.equal(k, key_cache) and torch.equal(v, value_cache)
    k[1, 2, 1, 3] = -1.0  # a view, not a copy: our stores land in vLLM's tensor
    assert cache[0, 1, 2, 1, 3] == -1.0


def test_logical_pages_views_slice_k_and_v_out_of_each_page():
    pages = torch.randn(NB, KH, BS, 2 * D)  # vLLM 0.32's [blocks, KV heads, tokens, K | V]
    k, v = kv_layout.attention_views(pages, "mha", "logical_pages")
    assert k.shape == v.shape == (NB, BS, KH, D)
    for b, n, h in [(0, 0, 0), (2, 3, 1), (1, 2, 0)]:
        assert torch.equal(k[b, n, h], pages[b, h, n, :D]) and torch.equal(v[b, n, h], pages[b, h, n, D:])
    v[2, 1, 0, 5] = 7.0
    assert pages[2, 0, 1, D + 5] == 7.0


@pytest.mark.parametrize("layout", ["planes", "logical_pages"])
def test_mla_gives_the_latent_cache_as_both_views(layout):
    cache = torch.randn(NB, BS, 1, 40) if layout == "planes" else torch.randn(NB, 1, BS, 40)
    k, v = kv_layout.attention_views(cache, "mla", layout)
    assert k.shape == (NB, BS, 1, 40) and k.data_ptr() == v.data_ptr() == cache.data_ptr()
    assert torch.equal(k[:, :, 0], cache[:, :, 0] if layout == "planes" else cache[:, 0])


@pytest.mark.parametrize("layout, shape, match", [
    ("planes", (NB, BS, KH, D), r"mha cache of shape \(3, 4, 2, 8\); the planes layout has \[2, NB, BS, KH, D\]"),
    ("planes", (3, NB, BS, KH, D), r"the planes layout has \[2, NB, BS, KH, D\]"),
    ("logical_pages", (2, NB, BS, KH, D), r"the logical_pages layout has \[blocks, KV heads, tokens, C\]"),
    ("pages", (NB, KH, BS, 2 * D), r"unknown KV cache layout 'pages'; known: planes, logical_pages"),
])
def test_a_cache_of_another_shape_is_refused_naming_the_expected_one(layout, shape, match):
    with pytest.raises(ValueError, match=match):
        kv_layout.attention_views(torch.zeros(shape), "mha", layout)
