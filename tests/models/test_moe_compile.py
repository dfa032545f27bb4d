"""MoE layers under torch.compile (what compile levels 2/3 do to each decoder layer): the
experts run as one opaque op, so fullgraph tracing succeeds and tokens equal eager."""
import pytest

from tests.models.harness import compiled_equals_eager


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_compiled_moe_layers_equal_eager(request, arch):
    compiled_equals_eager(request.getfixturevalue(f"tiny_{arch}"))
