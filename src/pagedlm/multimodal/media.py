"""Images from API content parts: data URLs, http(s) URLs and allowed local files.

Every failure is a ``MediaError`` (a ``ValueError``: HTTP 400) naming the problem: a URL
that does not parse, an unsupported URL scheme, an http(s) URL, or a redirect it takes, to a host outside
``--allowed-media-domains``, a download that times out or exceeds ``media_max_bytes``, a
``file://`` path outside ``--allowed-local-media-path`` (or none allowed), bytes PIL cannot
decode, and decompression bombs.

Pixel limit: PIL refuses images above twice ``Image.MAX_IMAGE_PIXELS`` and only warns above
it. pagedlm sets the limit to ``MAX_IMAGE_PIXELS`` (64 Mpx, larger than any vision
model's input needs, small enough that a decoded RGB image stays under 200 MB) and turns
the warning into a refusal, so the limit is one number.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
import time
import urllib.parse
import warnings
from typing import Any

from PIL import Image

from pagedlm.config import MultiModalConfig

MAX_IMAGE_PIXELS = 64 * 2**20
Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS


class MediaError(ValueError):
    """An image that cannot be used (answered with HTTP 400)."""


def decode_image(data: bytes) -> Image.Image:
    """Decode and fully load image bytes (RGB), refusing bombs and undecodable data."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            image.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise MediaError(
            f"the image is too large to decode ({exc}); the limit is {MAX_IMAGE_PIXELS} "
            "pixels: send a smaller image."
        ) from None
    except Image.UnidentifiedImageError:  # its message shows only a BytesIO's repr
        raise MediaError(
            "the image data could not be decoded: it is not an image in a format PIL reads; "
            "send a PNG, JPEG, WebP or GIF image."
        ) from None
    except Exception as exc:  # PIL raises many types for corrupt data
        raise MediaError(
            f"the image data could not be decoded ({type(exc).__name__}: {exc}); send a "
            "PNG, JPEG, WebP or GIF image."
        ) from None
    return to_rgb(image)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited onto white, as vLLM's image loader and
    transformers' ``convert_to_rgb`` do (``convert("RGB")`` alone drops the alpha channel
    and shows whatever colour the transparent pixels store, often black)."""
    if "A" not in image.getbands() and image.info.get("transparency") is None:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def _check_size(num_bytes: int, config: MultiModalConfig, what: str) -> None:
    if num_bytes > config.media_max_bytes:
        raise MediaError(
            f"{what} is larger than the limit of {config.media_max_bytes} bytes; send a "
            "smaller image (or raise --media-max-bytes)."
        )


def _data_url_bytes(url: str, config: MultiModalConfig) -> bytes:
    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        raise MediaError("an image data URL must be base64: 'data:image/png;base64,...'.")
    if not payload.strip():
        raise MediaError(
            "the image data URL carries no image after its comma: send "
            "'data:image/png;base64,<the image's bytes in base64>'."
        )
    _check_size(len(payload) * 3 // 4, config, "the data URL's image")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(
            "the image data URL is not valid base64: encode the image's bytes in standard "
            "base64 (A-Z, a-z, 0-9, '+', '/', '=' padding), with no line breaks, spaces or "
            "URL-safe '-' and '_'."
        ) from None


def _local_file_bytes(url: str, config: MultiModalConfig) -> bytes:
    allowed = config.allowed_local_media_path
    if allowed is None:
        raise MediaError(
            "file:// image URLs are refused: the server was started without "
            "--allowed-local-media-path (LLM: allowed_local_media_path=); set it to the "
            "directory the images may come from, or send the image as a data: URL."
        )
    path = os.path.realpath(urllib.parse.unquote(urllib.parse.urlparse(url).path))
    if os.path.commonpath([path, allowed]) != allowed:
        raise MediaError(
            f"the image path {path!r} is outside the allowed directory {allowed!r} "
            "(--allowed-local-media-path)."
        )
    if not os.path.isfile(path):
        missing = "is not a file" if os.path.exists(path) else "does not exist"
        raise MediaError(f"the image file {path!r} {missing}; name an image file.")
    _check_size(os.path.getsize(path), config, "the image file")
    with open(path, "rb") as file:
        return file.read()


_WELL_FORMED_FIX = (
    "send a well-formed URL such as 'https://example.com/image.png', or the image inline "
    "as a data: URL (base64)"
)


def _unparsable(url: str, problem: str) -> MediaError:
    return MediaError(
        f"the image URL {url[:80]!r} cannot be parsed ({problem[:120]}); {_WELL_FORMED_FIX}."
    )


def _scheme(url: str) -> str:
    """The URL's scheme, lower case; a ``MediaError`` naming the fix for a URL that does
    not parse (Python's own "Invalid IPv6 URL" names none) or has another scheme."""
    try:
        scheme = urllib.parse.urlsplit(url).scheme.lower() if isinstance(url, str) else ""
    except ValueError as error:
        raise _unparsable(url, str(error)) from None
    if scheme not in ("data", "file", "http", "https"):
        raise MediaError(
            f"unsupported image URL {str(url)[:60]!r}; use a data: URL (base64), "
            "http(s):// or file:// (under --allowed-local-media-path)."
        )
    if scheme in ("http", "https"):
        _check_http_url(url)
    return scheme


def _check_http_url(url: str) -> None:
    """Refuse, naming the fix, an http(s) URL that httpx or the host-name encoding would
    fail on with an error of their own (httpx's ``InvalidURL`` is no ``ValueError``)."""
    import httpx

    try:
        host = httpx.URL(url).host
        if not host:
            raise ValueError("it names no host")
        host.encode("idna")  # a label over 63 characters fails only when connecting
    except (httpx.InvalidURL, ValueError) as error:  # IDNA's errors are ValueErrors
        raise _unparsable(url, str(error)) from None


def _offline_bytes(url: str, scheme: str, config: MultiModalConfig) -> bytes:
    return _data_url_bytes(url, config) if scheme == "data" else _local_file_bytes(url, config)


def _check_host(url: str, config: MultiModalConfig) -> None:
    """Refuse an http(s) URL whose host is not in ``allowed_media_domains`` (exact host
    names, as vLLM compares them; ``hostname`` is lower case)."""
    allowed = config.allowed_media_domains
    if allowed is None:
        return
    host = urllib.parse.urlsplit(url).hostname
    if host not in allowed:
        raise MediaError(
            f"the image URL {url[:80]!r} is on host {host!r}, which is not among the "
            f"allowed media domains ({', '.join(allowed)}); use an image from one of them "
            "(--allowed-media-domains)."
        )


def _event_hooks(config: MultiModalConfig, *, is_async: bool) -> dict[str, list]:
    """httpx calls its request hooks before every hop, so a redirect is checked too."""
    if config.allowed_media_domains is None:
        return {}

    def check(request: Any) -> None:
        _check_host(str(request.url), config)

    async def check_async(request: Any) -> None:
        check(request)

    return {"request": [check_async if is_async else check]}


def _http_error(url: str, exc: Exception, config: MultiModalConfig) -> MediaError:
    import httpx

    if isinstance(exc, (httpx.TimeoutException, TimeoutError)):
        return MediaError(
            f"fetching the image {url[:80]!r} timed out after {config.media_fetch_timeout_s} s."
        )
    return MediaError(
        f"fetching the image {url[:80]!r} failed ({type(exc).__name__}: {exc}); check that "
        "the server can reach the URL, or send the image inline as a data: URL."
    )


def _checked_response(response: Any, url: str) -> None:
    if response.status_code != 200:
        raise MediaError(f"fetching the image {url[:80]!r} returned HTTP {response.status_code}.")


async def load_image_url_async(url: str, config: MultiModalConfig) -> Image.Image:
    """The image an API ``image_url`` names (the server's path: downloads do not block
    the event loop)."""
    scheme = _scheme(url)
    if scheme not in ("http", "https"):
        return decode_image(_offline_bytes(url, scheme, config))
    import httpx

    _check_host(url, config)
    chunks, size = [], 0
    try:
        # httpx's timeout bounds each read; this bounds the whole download (a server
        # dripping bytes never ends otherwise).
        async with (
            asyncio.timeout(config.media_fetch_timeout_s),
            httpx.AsyncClient(
                timeout=config.media_fetch_timeout_s,
                event_hooks=_event_hooks(config, is_async=True),
            ) as client,
            client.stream("GET", url, follow_redirects=True) as response,
        ):
            _checked_response(response, url)
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                _check_size(size, config, "the downloaded image")
                chunks.append(chunk)
    except (httpx.HTTPError, TimeoutError) as exc:
        raise _http_error(url, exc, config) from None
    return decode_image(b"".join(chunks))


def load_image_url(url: str, config: MultiModalConfig) -> Image.Image:
    """``load_image_url_async`` for offline callers (``LLM.chat``)."""
    scheme = _scheme(url)
    if scheme not in ("http", "https"):
        return decode_image(_offline_bytes(url, scheme, config))
    import httpx

    _check_host(url, config)
    chunks, size = [], 0
    deadline = time.monotonic() + config.media_fetch_timeout_s
    try:
        with (
            httpx.Client(
                timeout=config.media_fetch_timeout_s,
                event_hooks=_event_hooks(config, is_async=False),
            ) as client,
            client.stream("GET", url, follow_redirects=True) as response,
        ):
            _checked_response(response, url)
            for chunk in response.iter_bytes():
                size += len(chunk)
                _check_size(size, config, "the downloaded image")
                chunks.append(chunk)
                if time.monotonic() > deadline:
                    raise TimeoutError
    except (httpx.HTTPError, TimeoutError) as exc:
        raise _http_error(url, exc, config) from None
    return decode_image(b"".join(chunks))
