"""KV sizing of a vision-language model counts its encoder: the profiling step encodes one largest
image (the processor's own size limit) and holds a full encoder-output cache beside the dummy step."""
from __future__ import annotations

import pytest

from atom_core import LLMEngine
from atom_core.multimodal.processors import build_image_processor
from tests.models.kimi_k25_tiny import build_tiny_kimi
from tests.tiny_vlm import build_tiny_vlm


@pytest.fixture(scope="module", params=["qwen3_5", "kimi_k25"])
def vlm_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"encoder_profile_{request.param}")
    if request.param == "qwen3_5":
        return build_tiny_vlm(path, "qwen3_5")
    build_tiny_kimi(path)
    return path


def test_peak_step_encodes_one_largest_image(vlm_dir):
    engine = LLMEngine(str(vlm_dir), max_num_batched_tokens=64, max_model_len=256)
    runner = engine.core.executor.runner
    largest = build_image_processor(vlm_dir, None).max_tokens_per_image
    encoded = []
    encode = runner.model.encode_images

    def recording(items):
        encoded.append([item.length for item in items])
        return encode(items)

    runner.model.encode_images = recording
    scratch = runner._run_peak_step()
    assert len(encoded) == 1 and len(encoded[0]) == 1, encoded
    assert 0.8 * largest <= encoded[0][0] <= largest, (encoded, largest)
    assert scratch > 0
    engine.shutdown()


def test_text_models_encode_nothing(tiny_llama):
    engine = LLMEngine(str(tiny_llama), max_num_batched_tokens=64, max_model_len=256)
    assert engine.core.executor.runner.encoder is None
    engine.core.executor.runner._run_peak_step()  # no processor is looked up for a text model
    engine.shutdown()
