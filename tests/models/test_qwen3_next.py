"""Qwen3-Next / Qwen3.5 pieces the engine tests do not reach: the state spec's checks and sizes, the
hybrid layer's refusals, and the KV manager's state-slot bookkeeping on its own."""
import pytest
import torch
from transformers import Qwen3NextConfig

from atom_core.engine.kv_cache import KVCacheManager
from atom_core.engine.sequence import Sequence
from atom_core.model_ops.kv_spec import StateSpec, allocate_state_cache, state_bytes_per_slot
from atom_core.models.qwen3_next import Qwen3NextForCausalLM
from atom_core.sampling_params import SamplingParams


def _config(**changes):
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=8, linear_value_head_dim=8, num_experts=0, layer_types=None,
                full_attention_interval=2)
    return Qwen3NextConfig(**{**base, **changes})


def test_state_spec_sizes_one_sequence():
    spec = StateSpec(num_heads=4, key_dim=8, value_dim=8, conv_channels=64, conv_kernel=4, conv_dtype=torch.bfloat16)
    assert spec.bytes_per_slot == 4 * 8 * 8 * 4 + 64 * 3 * 2
    with pytest.raises(ValueError, match="conv_kernel >= 2"):
        StateSpec(4, 8, 8, 64, 1, conv_dtype=torch.bfloat16)


def test_model_declares_state_for_linear_layers_only():
    model = Qwen3NextForCausalLM(_config())
    layers = [m for m in model.modules() if isinstance(getattr(m, "state_spec", None), StateSpec)]
    assert len(layers) == 1  # layer 0 linear, layer 1 full attention
    pools = allocate_state_cache(layers, 3, "cpu")
    assert pools[0].shape == (4, 4, 8, 8) and pools[0].dtype == torch.float32  # 3 slots + the scratch row
    assert pools[1].shape == (4, 2 * 16 + 32, 3)
    assert state_bytes_per_slot(layers) == layers[0].state_spec.bytes_per_slot


def test_unknown_layer_type_is_refused():
    config = _config()
    config.layer_types = ["linear_attention", "sliding_attention"]
    with pytest.raises(ValueError, match="unknown layer type 'sliding_attention'"):
        Qwen3NextForCausalLM(config)


def test_value_heads_must_be_a_multiple_of_key_heads():
    with pytest.raises(ValueError, match="value heads must be a multiple of key heads"):
        Qwen3NextForCausalLM(_config(linear_num_value_heads=3))


def test_kv_manager_hands_out_and_takes_back_state_slots():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True, num_state_slots=2)
    assert not kv.enable_prefix_caching
    seqs = [Sequence(str(i), [1, 2, 3], SamplingParams()) for i in range(3)]
    for seq in seqs[:2]:
        assert kv.can_allocate(seq, 3)
        kv.allocate(seq, 3)
    assert {s.state_slot for s in seqs[:2]} == {0, 1} and not kv.can_allocate(seqs[2], 3)
    kv.free(seqs[0])
    assert seqs[0].state_slot == -1 and kv.num_free_state_slots == 1
    kv.allocate(seqs[2], 3)
    assert seqs[2].state_slot == 0
