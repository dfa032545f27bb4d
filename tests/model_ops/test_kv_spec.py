"""Per-layer KV specs: sizing, grouping into cache tensors, the window check, the backends."""
import pytest
import torch

from atom_core.model_ops.attention import Attention, QKTransform
from atom_core.model_ops.attention_backends import get_attention_backend
from atom_core.model_ops.kv_spec import (
    KVSpec, allocate_kv_cache, attention_layers, check_attention_supported, kv_bytes_per_block, release_kv_cache,
    warm_up_attention,
)
from atom_core.model_ops.rotary import RotaryEmbedding


def make_layer(num_heads=4, num_kv_heads=2, head_dim=16, window=None, prefix="layer"):
    qk = QKTransform(RotaryEmbedding(head_dim, head_dim, 64, 10000.0))
    return Attention(num_heads, head_dim, head_dim**-0.5, num_kv_heads, qk, sliding_window=window, prefix=prefix)


class TestKVSpecSizing:
    def test_mha_stores_k_and_v_per_kv_head(self):
        assert KVSpec("mha", 8, 128, torch.bfloat16).bytes_per_token == 2 * 8 * 128 * 2

    def test_mqa_stores_one_kv_head(self):
        assert KVSpec("mha", 1, 64, torch.float32).bytes_per_token == 2 * 1 * 64 * 4

    def test_mla_stores_one_latent(self):
        assert KVSpec("mla", 1, 576, torch.bfloat16).bytes_per_token == 576 * 2

    def test_sliding_window_does_not_change_the_cost_of_a_token(self):
        full, windowed = KVSpec("mha", 2, 16, torch.float16), KVSpec("mha", 2, 16, torch.float16, sliding_window=8)
        assert full.bytes_per_token == windowed.bytes_per_token and full != windowed

    def test_rejects_bad_values(self):
        with pytest.raises(ValueError, match="unknown attention kind 'gqa'"):
            KVSpec("gqa", 2, 16, torch.float16)
        with pytest.raises(ValueError, match="one latent"):
            KVSpec("mla", 2, 576, torch.bfloat16)
        with pytest.raises(ValueError, match="sliding_window"):
            KVSpec("mha", 2, 16, torch.float16, sliding_window=0)

    def test_layer_declares_its_spec_in_the_default_dtype(self):
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.float16)
        try:
            layer = make_layer(num_kv_heads=1, window=32)
        finally:
            torch.set_default_dtype(old)
        assert layer.kv_spec == KVSpec("mha", 1, 16, torch.float16, sliding_window=32)

    def test_block_bytes_sum_over_layers(self):
        layers = [make_layer(), make_layer(num_kv_heads=1), make_layer(window=8)]
        per_token = (2 * 2 * 16 + 2 * 1 * 16 + 2 * 2 * 16) * 4
        assert kv_bytes_per_block(layers, 16) == per_token * 16


class TestAllocation:
    def test_dense_layers_share_one_tensor_in_todays_layout(self):
        layers = [make_layer() for _ in range(3)]
        caches = allocate_kv_cache(layers, num_blocks=5, block_size=4, device="cpu")
        assert len(caches) == 1 and caches[0].shape == (2, 3, 5, 4, 2, 16) and caches[0].dtype == torch.float32
        for i, layer in enumerate(layers):
            assert layer.k_cache.data_ptr() == caches[0][0, i].data_ptr() and layer.k_cache.shape == (5, 4, 2, 16)
            assert layer.v_cache.data_ptr() == caches[0][1, i].data_ptr()
        layers[2].v_cache[3, 1] = 7.0  # a view: writes land in the group tensor
        assert caches[0][1, 2, 3, 1].eq(7.0).all() and caches[0].sum() == 7.0 * 2 * 16

    def test_layers_with_different_specs_get_separate_tensors(self):
        full_a, mqa, windowed, full_b = make_layer(), make_layer(num_kv_heads=1), make_layer(window=8), make_layer()
        caches = allocate_kv_cache([full_a, mqa, windowed, full_b], num_blocks=3, block_size=4, device="cpu")
        assert [tuple(c.shape) for c in caches] == [(2, 2, 3, 4, 2, 16), (2, 1, 3, 4, 1, 16), (2, 1, 3, 4, 2, 16)]
        assert full_b.k_cache.data_ptr() == caches[0][0, 1].data_ptr()
        assert mqa.v_cache.data_ptr() == caches[1][1, 0].data_ptr()
        assert windowed.k_cache.data_ptr() == caches[2][0, 0].data_ptr()

    def test_release_drops_the_views(self):
        layers = [make_layer()]
        allocate_kv_cache(layers, 2, 4, "cpu")
        release_kv_cache(layers)
        assert layers[0].k_cache.numel() == 0 and layers[0].v_cache.numel() == 0

    def test_attention_layers_finds_them_in_module_order(self):
        model = torch.nn.ModuleList([torch.nn.Linear(2, 2), make_layer(prefix="a"), make_layer(prefix="b")])
        assert [layer.prefix for layer in attention_layers(model)] == ["a", "b"]

    def test_warm_up_compiles_nothing_on_the_cpu(self):
        layers = [make_layer()]
        allocate_kv_cache(layers, 2, 4, "cpu")
        assert warm_up_attention(layers, max_tokens=64, threads=2) == 0


class TestSupportCheck:
    def test_refuses_a_window_shorter_than_max_model_len(self, monkeypatch):
        from atom_core.model_ops.attention_backends import PagedMHABackend

        monkeypatch.setattr(PagedMHABackend, "supports_sliding_window", False)  # a backend without windows
        layers = [make_layer(), make_layer(window=256, prefix="model.layers.1.self_attn.attn")]
        with pytest.raises(ValueError, match=r"model\.layers\.1.*sliding-window attention \(256 tokens\).*"
                                             r"max_model_len <= 256"):
            check_attention_supported(layers, max_model_len=257, device="cpu")

    def test_accepts_a_window_that_covers_max_model_len(self, monkeypatch):
        from atom_core.model_ops.attention_backends import PagedMHABackend

        monkeypatch.setattr(PagedMHABackend, "supports_sliding_window", False)
        check_attention_supported([make_layer(window=256)], max_model_len=256, device="cpu")

    @pytest.mark.parametrize("device", ["cpu", "cuda"])
    def test_paged_mha_masks_any_window(self, device):
        check_attention_supported([make_layer(window=8)], max_model_len=4096, device=device)

    def test_accepts_full_attention_at_any_length(self):
        check_attention_supported([make_layer()], max_model_len=1 << 20, device="cpu")

    def test_refuses_sinks_the_backend_lacks(self, monkeypatch):
        from atom_core.model_ops.attention_backends import PagedMHABackend

        monkeypatch.setattr(PagedMHABackend, "supports_sinks", False)  # a backend without sinks
        layer = make_layer()
        layer.kv_spec = KVSpec("mha", 2, 16, torch.float32, has_sinks=True)
        with pytest.raises(ValueError, match="attention sinks"):
            check_attention_supported([layer], max_model_len=16, device="cpu")

    @pytest.mark.parametrize("device", ["cpu", "cuda"])
    def test_paged_mha_adds_sinks(self, device):
        layer = make_layer(window=8)
        layer.kv_spec = KVSpec("mha", 2, 16, torch.float32, sliding_window=8, has_sinks=True)
        check_attention_supported([layer], max_model_len=4096, device=device)


class TestBackendRegistry:
    def test_one_instance_per_kind_and_device(self):
        assert get_attention_backend("mha", "cpu") is get_attention_backend("mha", torch.device("cpu"))

    def test_unknown_kind_names_what_exists(self):
        with pytest.raises(ValueError, match=r"no attention backend for 'mha' attention on 'meta'; available: mha@cpu, "
                                             r"mha@cuda, mla@cpu, mla@cuda"):
            get_attention_backend("mha", "meta")
