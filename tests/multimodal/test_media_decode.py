"""Decoded images with transparency: composited onto white, as vLLM's image loader and
transformers' ``convert_to_rgb`` do, not shown with the colour transparent pixels store."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from pagedlm.config import MultiModalConfig
from pagedlm.multimodal.media import decode_image, load_image_url


def _half_transparent(mode: str) -> Image.Image:
    """Left half opaque red (or mid grey for LA), right half fully transparent over black."""
    rgba = np.zeros((4, 6, 4), dtype=np.uint8)
    rgba[:, :3] = (200, 10, 10, 255) if mode == "RGBA" else (120, 120, 120, 255)
    return Image.fromarray(rgba, "RGBA").convert(mode)


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("mode", ["RGBA", "LA"])
def test_transparency_composites_onto_white_like_transformers(mode):
    from transformers.image_transforms import convert_to_rgb

    source = _half_transparent(mode)
    decoded = decode_image(_png(source))
    assert decoded.mode == "RGB"
    pixels = np.asarray(decoded)
    assert (pixels[:, 3:] == 255).all()  # transparent: white, not the stored black
    assert (pixels[:, :3] != 255).any()
    np.testing.assert_array_equal(pixels, convert_to_rgb(source, return_numpy=True))


def test_opaque_images_are_unchanged():
    rng = np.random.default_rng(0)
    source = Image.fromarray(rng.integers(0, 256, (5, 7, 3), dtype=np.uint8))
    url = "data:image/png;base64," + base64.b64encode(_png(source)).decode()
    decoded = load_image_url(url, MultiModalConfig())
    np.testing.assert_array_equal(np.asarray(decoded), np.asarray(source))


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("data:image/png;base64", "the image data URL carries no image"),
        ("data:image/png;base64,", "the image data URL carries no image"),
        ("data:image/png;base64," + base64.b64encode(b"not an image").decode(),
         "is not an image in a format PIL reads"),
    ],
)  # fmt: skip
def test_empty_and_unknown_image_data_say_so(url, message):
    # Not "cannot identify image file <_io.BytesIO object at 0x...>".
    with pytest.raises(ValueError, match=message) as error:
        load_image_url(url, MultiModalConfig())
    assert "BytesIO" not in str(error.value)
