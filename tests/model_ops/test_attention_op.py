"""The attention custom op: tensors and a layer key in, the backend reads the layer's own
norms and rotary cache; compiled layers (graph split at the op) equal eager ones."""
import torch
from transformers import AutoConfig

from atom_core.loader import build_model
from atom_core.model_ops.attention import Attention
from tests.models.harness import greedy_generate


def test_op_schema_is_tensors_and_a_key():
    schema = torch.ops.atom.paged_attention.default._schema
    assert [a.name for a in schema.arguments] == ["qkv", "positions", "layer_key", "q_width"]
    assert all(a.alias_info is None or not a.alias_info.is_write for a in schema.arguments)


def test_compiled_layers_through_the_op_equal_eager(tiny_qwen3):
    model = build_model(AutoConfig.from_pretrained(str(tiny_qwen3)), tiny_qwen3, torch.float32, "cpu")
    prompts = [[5], list(range(3, 40)), list(range(50, 60))]
    eager = greedy_generate(model, prompts, 6, chunk=16)
    for m in model.modules():
        if isinstance(m, Attention):
            m.use_custom_op = True
    torch._dynamo.reset()
    for layer in model.model.layers:
        layer.forward = torch.compile(layer.forward, dynamic=True, fullgraph=True)
    assert greedy_generate(model, prompts, 6, chunk=16) == eager
