"""Fixtures of the distributed tests: the tiny Llama and one worker's answers on it."""

from __future__ import annotations

import pytest
from parity import one_worker_run


@pytest.fixture(scope="session")
def llama(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def llama_reference(llama):
    """One in-process worker's greedy run on the tiny Llama."""
    return one_worker_run(llama)
