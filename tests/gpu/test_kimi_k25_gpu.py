"""Kimi-K2.5's vision tower on CUDA (SDPA's flash / memory-efficient kernels, float32 rotary): float32 equals
transformers' on the CPU elementwise; bfloat16 within 2% relative (Frobenius) error, which the CPU's bfloat16
run of this tiny model stays well inside."""
import pytest
import torch

from atom_core.loader import build_model
from atom_core.loader.model_dir import resolve_model_files
from tests.models.kimi_k25_tiny import build_tiny_kimi, random_patches

pytestmark = pytest.mark.gpu

GRIDS = [(1, 4, 6), (1, 10, 4), (1, 8, 8), (1, 8, 8)]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_kimi_gpu")
    return build_tiny_kimi(path), resolve_model_files(str(path)).hf_config, path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grids", [GRIDS, GRIDS[2:]], ids=["mixed_sizes", "one_size"])
@torch.inference_mode()
def test_tower_on_cuda_equals_transformers(kimi, dtype, grids):
    hf, config, path = kimi
    model = build_model(config, path, dtype, "cuda")
    pixels = random_patches(grids)
    expected = torch.cat(hf.model.get_image_features(pixels, torch.tensor(grids), return_dict=True).pooler_output)
    got = model.mm_projector(model.vision_tower(pixels.cuda(), grids), grids)
    assert got.dtype == dtype
    got = got.float().cpu()
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    else:
        assert (got - expected).norm() / expected.norm() < 2e-2


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 32}, {"enable_prefix_caching": True}],
                         ids=["defaults", "chunked", "prefix_caching"])
def test_engine_with_images_on_cuda_equals_transformers(tmp_path_factory, options):
    """float32 on CUDA, graphs on for decode: the same tokens as transformers on the CPU."""
    import json

    import transformers as tf

    from atom_core import LLMEngine
    from atom_core.multimodal.processors.kimi_k25 import KimiK25ImageProcessor
    from tests.models.test_kimi_k25_engine import CASES, GREEDY, _hf_reference, _images, _messages

    path = tmp_path_factory.mktemp("tiny_kimi_engine_gpu")
    hf = build_tiny_kimi(path)
    tokenizer = tf.AutoTokenizer.from_pretrained(str(path))
    processor = KimiK25ImageProcessor(path, json.loads((path / "config.json").read_text()), tokenizer)
    refs = [_hf_reference(hf, tokenizer, processor, c) for c in CASES]
    engine = LLMEngine(str(path), device="cuda", dtype="float32", num_kv_blocks=256, **options)
    prompts = [tokenizer.apply_chat_template(_messages(c), tokenize=False, add_generation_prompt=True) for c in CASES]
    out = engine.generate(prompts, GREEDY, images=[_images(c) for c in CASES])
    assert [o["token_ids"] for o in out] == refs
