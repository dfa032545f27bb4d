"""Image bytes -> a checked RGB PIL image, for every family's processor (processors/base.py). Bad input
is a ValueError that says what is wrong, never a decoder traceback."""
from __future__ import annotations

import io
import warnings

from PIL import Image

# Refuse before decoding: a small compressed file can claim a huge canvas (a decompression bomb).
MAX_IMAGE_PIXELS = 64 * 1024 * 1024


def load_image(data: bytes, max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """Decode `data` (any format PIL reads) into an RGB image; transparency is composited onto white,
    as HF's image processors do. ValueError for bytes that are no image, a truncated or corrupt file,
    or more than max_pixels pixels."""
    if not data:
        raise ValueError("the image is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > max_pixels:
                raise ValueError(f"the image is {width}x{height} = {width * height} pixels; at most {max_pixels} "
                                 "are accepted")
            image.load()
    except (OSError, SyntaxError, Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ValueError(f"cannot decode the image ({len(data)} bytes): {type(e).__name__}: {e}") from None
    if width < 1 or height < 1:
        raise ValueError(f"the image is {width}x{height}; it needs at least one pixel")
    return to_rgb(image)


def to_rgb(image: Image.Image) -> Image.Image:
    """HF's convert_to_rgb: transparency composited onto a white background, then RGB."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")
