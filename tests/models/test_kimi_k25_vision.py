"""Kimi-K2.5's vision tower and projector (models/kimi_k25_vision.py) against transformers' on a tiny random model:
image embeddings within float32 tolerance for images of different grids (one at the learned table's size, others
resampled), loaded from the file transformers saves (q/k un-permuted: the published checkpoint's layout)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from atom_core.loader.model_dir import resolve_model_files
from atom_core.loader.model_loader import build_model
from atom_core.models.kimi_k25_vision import apply_rotary_2d, kimi_vision_dims, rotary_2d
from tests.models.kimi_k25_tiny import build_tiny_kimi, kimi_config, random_patches


class _Vision:
    """Our tower + projector of a model the loader built."""

    def __init__(self, model):
        self.vision_tower, self.mm_projector = model.vision_tower, model.mm_projector

    def __call__(self, pixels, grids):
        return self.mm_projector(self.vision_tower(pixels, grids), grids)


@pytest.fixture(scope="module")
def hf_and_ours(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_kimi_vision")
    hf = build_tiny_kimi(path)
    files = resolve_model_files(str(path))
    return hf, _Vision(build_model(files.hf_config, path, torch.float32, "cpu"))


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


@pytest.mark.parametrize("field, value, message", [("merge_type", "sd2", "merge_type 'sd2' is not supported"),
                                                  ("hidden_act", "relu", "hidden_act 'relu' is not supported"),
                                                  ("mm_hidden_size", 48, "projector input size 48 differs")])
def test_unsupported_vision_options_are_refused(field, value, message):
    vision = kimi_config().vision_config
    setattr(vision, field, value)
    with pytest.raises(ValueError, match=message):
        kimi_vision_dims(SimpleNamespace(vision_config=vision, hidden_size=64))


def test_published_field_names_win_over_transformers_defaults():
    """transformers reads the published vision_config (vt_*, init_pos_emb_*, mm_hidden_size) into its own
    fields' defaults (hidden_size 1152, ...); the tower is sized by the published names."""
    vision = kimi_config().vision_config
    vision.hidden_size, vision.pos_emb_height = 1152, 64
    vision.vt_hidden_size, vision.init_pos_emb_height, vision.mm_hidden_size = 32, 8, 32
    dims = kimi_vision_dims(SimpleNamespace(vision_config=vision, hidden_size=64, projection_hidden_size=1152))
    assert (dims.hidden_size, dims.pos_emb_height, dims.text_hidden_size) == (32, 8, 64)
