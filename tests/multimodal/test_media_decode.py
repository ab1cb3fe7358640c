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


MALFORMED_URLS = [
    ("http://[::1", "Invalid IPv6 URL"),  # Python's words, and nothing more, before
    ("file://[::1", "Invalid IPv6 URL"),
    ("https://[not-ipv6]/x.png", "does not appear to be an IPv4 or IPv6 address"),
    ("http://[::1]:abc/x.png", "Invalid port"),  # httpx's InvalidURL: a 500 before
    ("http://exa\x00mple/x.png", "non-printable"),
    ("http:///x.png", "names no host"),
    ("http://xn--/x.png", "Malformed A-label"),
    ("http://" + "a" * 300 + "/x.png", "label too long"),  # failed when connecting
]


@pytest.mark.parametrize(("url", "problem"), MALFORMED_URLS)
def test_a_url_that_does_not_parse_is_a_media_error_naming_the_fix(url, problem):
    import asyncio

    from pagedlm.multimodal.media import MediaError, load_image_url_async

    config = MultiModalConfig(media_fetch_timeout_s=0.5)
    for load in (load_image_url, lambda *args: asyncio.run(load_image_url_async(*args))):
        with pytest.raises(MediaError, match="cannot be parsed") as error:
            load(url, config)
        assert problem in str(error.value)
        assert "send a well-formed URL" in str(error.value)
