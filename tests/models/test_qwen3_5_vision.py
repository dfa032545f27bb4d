"""Qwen3.5's vision tower and multimodal rotary against HF on a tiny random checkpoint: the encoder's
output per image, the on-device patch layout (pixel_patches) against HF's PIL image processor, and
mrope_positions against HF's get_rope_index."""
import numpy as np
import pytest
import torch

from atom_core.loader import build_model
from atom_core.loader.model_dir import resolve_model_files
from atom_core.models.qwen3_5_vision import pixel_patches
from atom_core.multimodal.processors.qwen3_5 import Qwen3_5ImageProcessor
from tests.tiny_vlm import MERGE, PATCH, build_tiny_vlm, hf_image_processor, hf_inputs, synthetic_image

SIZES = [(50, 37), (64, 64), (13, 90), (300, 20)]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    import transformers as tf

    path = build_tiny_vlm(tmp_path_factory.mktemp("tiny_qwen3_5_vlm"))
    files = resolve_model_files(str(path))
    ours = build_model(files.hf_config, path, torch.float32, "cpu")
    hf = tf.Qwen3_5ForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()
    tokenizer = tf.AutoTokenizer.from_pretrained(str(path))
    processor = Qwen3_5ImageProcessor(path, files.hf_config.to_dict() | {"vision_config": files.hf_config.vision_config.to_dict()}, tokenizer)
    return ours, hf, tokenizer, processor


def _item(processor, image):
    from atom_core.multimodal.inputs import MultimodalItem, content_hash

    processed = processor.preprocess(image)
    return MultimodalItem(0, processed.num_tokens, content_hash("qwen3_5", processed.data), processed.data)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L"])
def test_patches_equal_hf_pil_image_processor(vlm, size, mode):
    _, _, _, processor = vlm
    image = synthetic_image(3, size, mode)
    expected = hf_image_processor()(images=[image], return_tensors="np")
    data = processor.preprocess(image).data
    assert data["grid_thw"].tolist() == expected["image_grid_thw"][0].tolist()
    ours = pixel_patches(torch.from_numpy(data["pixels"]), torch.from_numpy(data["image_mean"]),
                         torch.from_numpy(data["image_std"]), PATCH, MERGE, 2)
    assert torch.equal(ours, torch.from_numpy(expected["pixel_values"]))


@torch.inference_mode()
def test_encoder_output_equals_hf_image_features(vlm):
    ours, hf, _, processor = vlm
    images = [synthetic_image(s, size) for s, size in enumerate(SIZES)]
    pix = hf_image_processor()(images=images, return_tensors="pt")
    expected = hf.model.get_image_features(pix["pixel_values"], pix["image_grid_thw"]).pooler_output
    got = ours.encode_images([_item(processor, im) for im in images])
    assert [g.shape for g in got] == [e.shape for e in expected]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_mrope_positions_equal_hf_rope_index(vlm):
    ours, hf, tokenizer, processor = vlm
    images = [synthetic_image(7, (50, 37)), synthetic_image(8, (13, 90))]
    messages = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "image"},
                                             {"type": "text", "text": "and two"}, {"type": "image"}]}]
    inputs = hf_inputs(tokenizer, messages, images)
    expected, delta = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                              image_grid_thw=inputs["image_grid_thw"])
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    ids, items = processor.expand(list(ids), [processor.preprocess(im) for im in images])
    assert ids == inputs["input_ids"][0].tolist()
    positions, ours_delta = ours.mrope_positions(ids, items)
    np.testing.assert_array_equal(positions, expected[:, 0].numpy())
    assert ours_delta == int(delta)
    assert ours.mrope_positions(ids, ()) is None
