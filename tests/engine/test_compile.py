"""The torch.compile path (levels 2/3) on the CPU: attention as an opaque custom op, the rest
compiled by Inductor with a dynamic token count; outputs equal eager token for token."""
import random

import torch

from atom_core import LLMEngine, SamplingParams
from atom_core.worker.compile import compile_model
from atom_core.model_ops.attention import Attention


def test_compiled_model_equals_eager(tiny_qwen3):
    engine = LLMEngine(str(tiny_qwen3), device="cpu", max_num_batched_tokens=64)
    rng = random.Random(0)
    prompts = [[rng.randint(3, 300) for _ in range(rng.randint(3, 90))] for _ in range(5)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    eager = [o["token_ids"] for o in engine.generate(prompts, params)]
    compile_model(engine.core.executor.runner.model)
    assert all(m.use_custom_op for m in engine.core.executor.runner.model.modules() if isinstance(m, Attention))
    compiled = [o["token_ids"] for o in engine.generate(prompts, params)]  # chunked prefill + decode shapes
    assert compiled == eager
    assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks


def test_custom_op_is_opaque_and_declares_no_mutation():
    schema = torch.ops.atom.paged_attention.default._schema
    assert all(a.alias_info is None or not a.alias_info.is_write for a in schema.arguments)


def test_one_token_steps_equal_eager(tiny_qwen3):
    """A 1-token prefill and 1-token decodes run Dynamo's size-1 specialisation: same tokens."""
    from torch._dynamo.utils import counters

    engine = LLMEngine(str(tiny_qwen3), device="cpu")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5], [7, 8, 9, 10]]
    eager = [o["token_ids"] for o in engine.generate(prompts[:1], params) + engine.generate(prompts, params)]
    torch._dynamo.reset()
    counters.clear()
    compile_model(engine.core.executor.runner.model)
    compiled = [o["token_ids"] for o in engine.generate(prompts[:1], params) + engine.generate(prompts, params)]
    assert compiled == eager
    assert counters["stats"]["unique_graphs"] == 4  # (first layer, other layers) x (1 token, many)


def test_all_decoder_layers_share_one_compiled_graph(tmp_path):
    from torch._dynamo.utils import counters

    from tests.tiny_models import build_tiny_model

    engine = LLMEngine(str(build_tiny_model(tmp_path, "llama", num_layers=5)), device="cpu")
    torch._dynamo.reset()
    counters.clear()
    compile_model(engine.core.executor.runner.model)
    engine.generate([[3, 4, 5, 6]], SamplingParams(temperature=0, max_tokens=1))  # one 4-token step
    assert counters["stats"]["unique_graphs"] == 2  # the first layer (no residual yet) and the rest


def test_several_compiled_engines_in_one_process(tiny_llama, tiny_qwen3):
    """Each engine adds cache entries to the shared layer code; a third one must still compile."""
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    torch._dynamo.reset()
    for path, dtype in ((tiny_llama, "float32"), (tiny_qwen3, "float32"), (tiny_llama, "bfloat16")):
        engine = LLMEngine(str(path), device="cpu", dtype=dtype)
        run = lambda: [engine.generate([p], params)[0]["token_ids"] for p in ([5], [6, 7, 8])]  # noqa: E731
        eager = run()
        compile_model(engine.core.executor.runner.model)
        compiled = run()  # 1-token and many-token graphs for the first and the other layers
        assert [len(t) for t in compiled] == [3, 3]
        if dtype == "float32":  # bf16 rounding may differ between Inductor and eager
            assert compiled == eager
