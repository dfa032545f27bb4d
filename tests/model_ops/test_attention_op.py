"""The attention custom op: tensors and a layer key in, the backend reads the layer's own
norms and rotary cache; compiled layers (graph split at the op) equal eager ones."""
import torch

from tests.models.harness import compiled_equals_eager


def test_op_schema_is_tensors_and_a_key():
    schema = torch.ops.atom.paged_attention.default._schema
    assert [a.name for a in schema.arguments] == ["qkv", "positions", "layer_key", "q_width"]
    assert all(a.alias_info is None or not a.alias_info.is_write for a in schema.arguments)


def test_compiled_layers_through_the_op_equal_eager(tiny_qwen3):
    compiled_equals_eager(tiny_qwen3)
