"""Kimi-K2.5's vision tower and projector (models/kimi_k25_vision.py) against transformers' on a tiny random model:
image embeddings within float32 tolerance for images of different grids (one at the learned table's size, others
resampled), loaded from the file transformers saves (q/k un-permuted: the published checkpoint's layout)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from atom_core.models.kimi_k25_vision import (KimiProjector, KimiVisionTower, apply_rotary_2d, kimi_vision_dims,
                                              rotary_2d)
from tests.models.kimi_k25_tiny import build_tiny_kimi, random_patches


class _Vision(nn.Module):
    def __init__(self, config):
        super().__init__()
        dims = kimi_vision_dims(config)
        self.vision_tower = KimiVisionTower(dims)
        self.mm_projector = KimiProjector(dims)

    def forward(self, pixels, grids):
        return self.mm_projector(self.vision_tower(pixels, grids), grids)


@pytest.fixture(scope="module")
def hf_and_ours(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_kimi_vision")
    hf = build_tiny_kimi(path)
    ours = _Vision(hf.config).eval()
    params = dict(ours.named_parameters())
    loaded = set()
    for name, tensor in load_file(str(path / "model.safetensors")).items():
        if name.startswith("language_model."):
            continue
        # transformers' save_pretrained writes these two under other prefixes than the published files
        name = name.replace("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed.")
        name = name.removeprefix("model.")
        with torch.no_grad():
            params[name].copy_(tensor)
        loaded.add(name)
    assert loaded == set(params), f"not in the checkpoint: {set(params) - loaded}"
    return hf, ours


def _hf_embeddings(hf, pixels, grids):
    with torch.no_grad():
        out = hf.model.get_image_features(pixels, torch.tensor(grids), return_dict=True)
    return torch.cat(out.pooler_output)


@pytest.mark.parametrize("grids", [[(1, 8, 8)], [(1, 4, 6)], [(1, 4, 6), (1, 10, 4), (1, 8, 8)], [(1, 6, 6)] * 2],
                         ids=["table_size", "resampled", "three_sizes", "two_same"])
def test_image_embeddings_match_transformers(hf_and_ours, grids):
    hf, ours = hf_and_ours
    pixels = random_patches(grids)
    with torch.no_grad():
        got = ours(pixels, grids)
    expected = _hf_embeddings(hf, pixels, grids)
    assert got.shape == (sum(h * w for _, h, w in grids) // 4, hf.config.text_config.hidden_size)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_an_image_embeds_the_same_alone_and_beside_another(hf_and_ours):
    """Attention stays within an image: its embeddings do not depend on the batch it is encoded in."""
    _, ours = hf_and_ours
    pixels = random_patches([(1, 4, 6), (1, 8, 8)])
    with torch.no_grad():
        both = ours(pixels, [(1, 4, 6), (1, 8, 8)])
        alone = ours(pixels[24:], [(1, 8, 8)])
    torch.testing.assert_close(both[6:], alone, rtol=1e-5, atol=1e-5)


def test_rotary_pairs_rotate_by_column_then_row():
    """Pair 2k turns by col * f_k, pair 2k+1 by row * f_k: a patch at row 0 leaves odd pairs unturned."""
    cos, sin = rotary_2d([(1, 2, 3)], head_dim=8, theta=10000.0, device="cpu")
    x = torch.randn(6, 1, 8)
    out = apply_rotary_2d(x, cos, sin)
    torch.testing.assert_close(out[:3, :, 2:4], x[:3, :, 2:4])  # row 0: pair 1 (row, f_0) unturned
    torch.testing.assert_close(out[[0, 3], :, 0:2], x[[0, 3], :, 0:2])  # col 0: pair 0 (col, f_0) unturned
    assert not torch.allclose(out[1, :, 0:2], x[1, :, 0:2])
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))


@pytest.mark.parametrize("grids, message", [([(2, 4, 4)], "takes images"), ([(1, 3, 4)], "merge kernel"),
                                            ([(1, 4, 4), (1, 4, 4)], "cover 32 patches")])
def test_bad_grids_are_refused(hf_and_ours, grids, message):
    _, ours = hf_and_ours
    with pytest.raises(ValueError, match=message):
        ours.vision_tower(random_patches([(1, 4, 4)]), grids)


def test_unsupported_vision_options_are_refused(hf_and_ours):
    import copy

    config = copy.deepcopy(hf_and_ours[0].config)
    config.vision_config.merge_type = "sd2"
    with pytest.raises(ValueError, match="merge_type 'sd2' is not supported"):
        kimi_vision_dims(config)
