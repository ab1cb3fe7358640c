"""Fixtures: a tiny chat checkpoint and one shared ``pagedlm serve`` subprocess."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from server_utils import Server, start_server, write_chat_checkpoint


@pytest.fixture(scope="session")
def chat_checkpoint(tmp_path_factory) -> Path:
    return write_chat_checkpoint(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="session")
def tiny_server(chat_checkpoint, tmp_path_factory) -> Iterator[Server]:
    """One shared server for the protocol tests (no API key)."""
    server = start_server(chat_checkpoint, tmp_path_factory.mktemp("logs") / "server.log")
    yield server
    server.stop()
