"""Kimi-K2.5's image preprocessing without torchvision (multimodal/processors/kimi_k25.py).

Against transformers: the resize / pad sizes against transformers' own `navit_resize` (read from its source:
the module imports torchvision); pixel values, grids and expanded token ids against Kimi_K25ImageProcessor and
Kimi_K25Processor where torchvision imports (PyPI's torchvision is a CUDA build that does not import beside
the CPU torch of CI, so there that test is skipped). On its own: the patch layout, the padding, the settings
read from either preprocessor_config.json format and the options refused."""
from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from atom_core.models.kimi_k25 import image_patches
from atom_core.multimodal.inputs import MultimodalItem
from atom_core.multimodal.processors.kimi_k25 import KimiImageSettings, KimiK25ImageProcessor, read_settings
from tests.models.kimi_k25_tiny import PREPROCESSOR, build_kimi_tokenizer, build_tiny_kimi


def _hf_navit_resize():
    """transformers' navit_resize, compiled from its module's source (importing the module needs torchvision)."""
    import transformers.models.kimi_k25 as pkg

    source = (Path(pkg.__file__).parent / "image_processing_kimi_k25.py").read_text()
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "navit_resize")
    namespace = {"math": math}
    exec(compile(ast.Module(body=[node], type_ignores=[]), "navit_resize", "exec"), namespace)
    return namespace["navit_resize"]


@pytest.mark.parametrize("settings", [KimiImageSettings(), KimiImageSettings(patch_size=4, max_patches=256,
                                                                             max_size_per_side=16)],
                         ids=["published", "tiny"])
def test_sizes_equal_transformers_navit_resize(settings):
    navit = _hf_navit_resize()
    sizes = [(1, 1), (3, 500), (13, 13), (37, 53), (224, 224), (768, 512), (1024, 1024), (1000, 1003), (2048, 96),
             (4096, 4096), (8192, 256), (28672, 224), (63, 65), (200, 70)]
    for h, w in sizes:
        expected = navit(h, w, settings.patch_size, settings.merge_size, settings.max_patches,
                         settings.max_size_per_side)
        assert settings.resized_and_padded(h, w) == expected, (h, w)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_kimi_processor")
    build_tiny_kimi(path)
    return path


def _processor(model_dir):
    from transformers import AutoTokenizer

    return KimiK25ImageProcessor(model_dir, json.loads((model_dir / "config.json").read_text()),
                                 AutoTokenizer.from_pretrained(str(model_dir)))


def _images():
    rng = np.random.default_rng(0)
    rgba = rng.integers(0, 256, (30, 20, 4), dtype=np.uint8)
    return [Image.fromarray(rng.integers(0, 256, (24, 40, 3), dtype=np.uint8)),  # padded only
            Image.fromarray(rng.integers(0, 256, (100, 70, 3), dtype=np.uint8)),  # shrunk, then padded
            Image.fromarray(rgba, "RGBA"),  # alpha over white
            Image.fromarray(rng.integers(0, 256, (9, 150), dtype=np.uint8), "L")]


def _item(processed):
    return MultimodalItem(0, processed.num_tokens, 0, processed.data)


def test_pixels_and_token_ids_equal_transformers_processor(model_dir):
    pytest.importorskip("torchvision")
    from transformers import AutoTokenizer, Kimi_K25ImageProcessor, Kimi_K25Processor, Kimi_K25VideoProcessor

    hf_images = Kimi_K25ImageProcessor(**{k: v for k, v in PREPROCESSOR.items() if k != "processor_class"})
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ours = _processor(model_dir)
    images = _images()
    expected = hf_images(images, return_tensors="pt")
    processed = [ours.preprocess(image) for image in images]
    got = torch.cat([image_patches(_item(p), ours.settings.patch_size, torch.device("cpu")) for p in processed])
    assert torch.equal(torch.tensor(np.stack([p.data["grid_thw"] for p in processed])), expected["image_grid_thw"])
    assert torch.equal(got, expected["pixel_values"])

    hf = Kimi_K25Processor(image_processor=hf_images, tokenizer=tokenizer, video_processor=Kimi_K25VideoProcessor(),
                           chat_template=tokenizer.chat_template)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hello"}, {"type": "image"}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    hf_ids = hf(text=[text], images=images[:2], return_tensors="pt")["input_ids"][0].tolist()
    ids, items = ours.expand(tokenizer(text)["input_ids"], processed[:2])
    assert ids == hf_ids
    assert [(i.offset, i.length) for i in items] == [(ids.index(ours.placeholder_token_id), processed[0].num_tokens),
                                                      (items[1].offset, processed[1].num_tokens)]


def test_patches_are_row_major_normalised_and_padded_with_minus_one(model_dir):
    """A 20 x 40 image needs no resize (within 16 patches a side) and pads to 24 x 40 (multiples of 4 * 2):
    patch row 5 is padding. Patch (r, c) holds pixels [4r, 4r + 4) x [4c, 4c + 4)."""
    ours = _processor(model_dir)
    rng = np.random.default_rng(1)
    rgb = rng.integers(0, 256, (20, 40, 3), dtype=np.uint8)
    processed = ours.preprocess(Image.fromarray(rgb))
    assert processed.data["grid_thw"].tolist() == [1, 6, 10] and processed.num_tokens == 15
    patches = image_patches(_item(processed), 4, torch.device("cpu"))  # [60, 3, 4, 4]
    normalised = (torch.from_numpy(rgb).permute(2, 0, 1).float() - 127.5) / 127.5
    for r, c in [(0, 0), (2, 7), (4, 9)]:
        torch.testing.assert_close(patches[r * 10 + c], normalised[:, 4 * r:4 * r + 4, 4 * c:4 * c + 4], rtol=0,
                                   atol=0)
    assert torch.equal(patches[50:], torch.full_like(patches[50:], -1.0))  # row 5: pixels 20..23, all padding


def test_large_images_shrink_within_the_patch_limits(model_dir):
    processed = _processor(model_dir).preprocess(Image.new("RGB", (1000, 300), (10, 200, 30)))
    _, gh, gw = processed.data["grid_thw"].tolist()
    assert gw <= 16 and gh * gw <= 256 and gh % 2 == 0 and gw % 2 == 0
    assert processed.num_tokens == gh * gw // 4


def test_two_images_hash_apart_and_one_image_hashes_the_same(model_dir):
    ours = _processor(model_dir)
    ids = [1, ours.placeholder_token_id, 2]
    a, b = (ours.preprocess(Image.new("RGB", (30, 30), color)) for color in ((0, 0, 0), (0, 0, 1)))
    _, (item_a,) = ours.expand(ids, [a])
    _, (item_b,) = ours.expand(ids, [b])
    _, (item_a2,) = ours.expand(ids, [ours.preprocess(Image.new("RGB", (30, 30), (0, 0, 0)))])
    assert item_a.content_hash != item_b.content_hash and item_a.content_hash == item_a2.content_hash


def test_published_media_proc_cfg_is_read(tmp_path):
    cfg = {"media_proc_cfg": {"in_patch_limit": 4096, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5],
                              "image_std": [0.5, 0.5, 0.5], "merge_kernel_size": 2, "fixed_output_tokens": None,
                              "patch_limit_on_one_side": 100, "in_patch_limit_each_frame": 4096}}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(cfg))
    assert read_settings(tmp_path) == KimiImageSettings(max_patches=4096, max_size_per_side=100)
    assert read_settings(tmp_path / "absent") == KimiImageSettings()


@pytest.mark.parametrize("change, message", [({"do_normalize": False}, "do_normalize=False is not supported"),
                                             ({"resample": 2}, "resample=2 is not supported"),
                                             ({"size": {"max_height": 16, "max_width": 8}}, "equal max_height"),
                                             ({"media_proc_cfg": {"fixed_output_tokens": 64}}, "fixed_output_tokens")])
def test_unsupported_preprocessor_options_are_refused(tmp_path, change, message):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**PREPROCESSOR, **change}))
    with pytest.raises(ValueError, match=message):
        read_settings(tmp_path)


def test_config_and_tokenizer_must_agree_on_the_image_token(model_dir, tmp_path):
    tokenizer = build_kimi_tokenizer(tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    pad = tokenizer.convert_tokens_to_ids("<|media_pad|>")
    assert KimiK25ImageProcessor(model_dir, config, tokenizer).placeholder_token_id == pad
    with pytest.raises(ValueError, match="is not the tokenizer's <\\|media_pad\\|>"):
        KimiK25ImageProcessor(model_dir, {**config, "media_placeholder_token_id": pad + 1}, tokenizer)
    with pytest.raises(ValueError, match="preprocessor patch_size 4 differs from vision_config.patch_size 14"):
        KimiK25ImageProcessor(model_dir, {**config, "vision_config": {"patch_size": 14}}, tokenizer)


@pytest.mark.parametrize("settings", [KimiImageSettings(patch_size=4, max_patches=256, max_size_per_side=16),
                                      KimiImageSettings(patch_size=4, max_patches=64, max_size_per_side=16),
                                      KimiImageSettings(patch_size=3, max_patches=500, max_size_per_side=30),
                                      KimiImageSettings(patch_size=5, max_patches=40, max_size_per_side=1)],
                         ids=["side_capped", "patch_capped", "odd_sizes", "one_patch_a_side"])
def test_max_tokens_bounds_every_image_size(settings):
    """Every image size up to six times the largest side the settings keep (h <= w: the sizes are symmetric):
    none exceeds the bound, which stays within a third of the largest count seen."""
    limit = settings.patch_size * settings.max_size_per_side * 6
    worst = 0
    for h in range(1, limit + 1):
        for w in range(h, limit + 1):
            (_, _), (ph, pw) = settings.resized_and_padded(h, w)
            worst = max(worst, (ph // settings.patch_size) * (pw // settings.patch_size) // settings.merge_size ** 2)
    assert worst <= settings.max_tokens() <= max(worst * 4 // 3, worst + 4)
