"""multimodal/media.py: image bytes -> RGB PIL image, or a ValueError saying what is wrong."""
import io

import numpy as np
import pytest
from PIL import Image

from atom_core.multimodal.media import load_image
from tests.tiny_vlm import png_bytes, synthetic_image


def test_formats_and_modes_decode_to_rgb_with_transparency_on_white():
    rgba = Image.new("RGBA", (4, 3), (10, 20, 30, 0))  # fully transparent: white after compositing
    image = load_image(png_bytes(rgba))
    assert image.mode == "RGB" and image.size == (4, 3) and image.getpixel((0, 0)) == (255, 255, 255)
    buf = io.BytesIO()
    synthetic_image(1, (9, 7)).convert("L").save(buf, format="JPEG")
    assert load_image(buf.getvalue()).mode == "RGB"


@pytest.mark.parametrize("data, message", [
    (b"", "empty"),
    (b"GIF89a but not really", "cannot decode"),
    (png_bytes(synthetic_image(2, (30, 30)))[:200], "cannot decode"),  # truncated
])
def test_bad_bytes_are_value_errors(data, message):
    with pytest.raises(ValueError, match=message):
        load_image(data)


def test_too_many_pixels_are_refused_before_decoding():
    data = png_bytes(Image.fromarray(np.zeros((20, 30, 3), np.uint8)))
    with pytest.raises(ValueError, match="30x20 = 600 pixels; at most 599"):
        load_image(data, max_pixels=599)
    assert load_image(data, max_pixels=600).size == (30, 20)
