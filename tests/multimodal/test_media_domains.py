"""``--allowed-media-domains``: http(s) image URLs, and every redirect they take, only from
the listed hosts (a local HTTP server on 127.0.0.1, reached as ``localhost`` too for a
second host name); the flag parsed and checked at the edge."""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from multimodal.tiny_common import random_image
from pagedlm.config import MultiModalConfig
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.engine.cli_args import add_engine_args, engine_args_from_cli
from pagedlm.multimodal.config_args import multimodal_config, parse_allowed_media_domains
from pagedlm.multimodal.media import MediaError, load_image_url, load_image_url_async


def _png() -> bytes:
    buffer = io.BytesIO()
    random_image(8, 6, 0).save(buffer, format="PNG")
    return buffer.getvalue()


class _Handler(BaseHTTPRequestHandler):
    png = _png()
    port = 0

    def do_GET(self):
        # /to/<host>: a redirect to the image on <host> (same server, other name).
        if self.path.startswith("/to/"):
            self.send_response(302)
            self.send_header("Location", f"http://{self.path[4:]}:{self.port}/cat.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(self.png)))
        self.end_headers()
        self.wfile.write(self.png)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def media_server() -> Iterator[int]:
    """A local server of ``_Handler``'s image (and redirects) on 127.0.0.1; its port."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    _Handler.port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def port():
    with media_server() as port:
        yield port


def _load(url: str, config: MultiModalConfig, use_async: bool):
    if use_async:
        return asyncio.run(load_image_url_async(url, config))
    return load_image_url(url, config)


LOCAL_ONLY = MultiModalConfig(allowed_media_domains=("127.0.0.1",))


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_allowed_host_and_redirect_within_it_load(port, use_async):
    for path in ("/cat.png", "/to/127.0.0.1"):
        image = _load(f"http://127.0.0.1:{port}{path}", LOCAL_ONLY, use_async)
        assert image.size == (8, 6)
    # No list: any host, redirects followed.
    image = _load(f"http://127.0.0.1:{port}/to/localhost", MultiModalConfig(), use_async)
    assert image.size == (8, 6)


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_other_host_is_refused_naming_the_flag(port, use_async):
    with pytest.raises(MediaError, match=r"host 'localhost'.*--allowed-media-domains"):
        _load(f"http://localhost:{port}/cat.png", LOCAL_ONLY, use_async)


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_redirect_to_another_host_is_refused(port, use_async):
    with pytest.raises(MediaError, match=r"host 'localhost'.*--allowed-media-domains"):
        _load(f"http://127.0.0.1:{port}/to/localhost", LOCAL_ONLY, use_async)


def test_hosts_compare_case_insensitively(port):
    config = MultiModalConfig(allowed_media_domains=parse_allowed_media_domains(["LocalHost"]))
    assert load_image_url(f"http://LOCALHOST:{port}/cat.png", config).size == (8, 6)


def test_data_urls_are_not_affected():
    data = "data:image/png;base64," + base64.b64encode(_png()).decode()
    assert load_image_url(data, LOCAL_ONLY).size == (8, 6)


def test_flag_parses_as_a_list_of_hosts():
    parser = add_engine_args(argparse.ArgumentParser())
    args = engine_args_from_cli(
        parser.parse_args(["--allowed-media-domains", "upload.wikimedia.org", "Example.com"])
    )
    assert args.allowed_media_domains == ["upload.wikimedia.org", "Example.com"]
    config = multimodal_config(args)
    assert config.allowed_media_domains == ("upload.wikimedia.org", "example.com")
    assert multimodal_config(EngineArgs(model="m")).allowed_media_domains is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (["https://example.com"], "not a host name"),
        (["example.com/images"], "not a host name"),
        ([""], "not a host name"),
        ([], "is empty"),
    ],
)
def test_bad_domain_lists_are_refused(value, message):
    with pytest.raises(ValueError, match=message):
        parse_allowed_media_domains(value)
