"""Fixtures: a tiny chat checkpoint and one shared ``pagedlm serve`` subprocess."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_utils import Server, start_server

# chat_checkpoint (tests/conftest.py) is shared with the other directories' server tests.


@pytest.fixture(scope="session")
def tiny_server(chat_checkpoint, tmp_path_factory) -> Iterator[Server]:
    """One shared server for the protocol tests (no API key)."""
    log = tmp_path_factory.mktemp("logs") / "server.log"
    server = start_server(chat_checkpoint, log, "--enable-tokenizer-info-endpoint")
    yield server
    server.stop()
