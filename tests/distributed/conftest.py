"""Fixtures of the distributed tests: the tiny Llama and one worker's answers on it."""

from __future__ import annotations

import pytest
from parity import greedy_run, make_llm


@pytest.fixture(scope="session")
def llama(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def llama_reference(llama):
    """One in-process worker's greedy run on the tiny Llama."""
    llm = make_llm(llama)
    try:
        return greedy_run(llm)
    finally:
        llm.llm_engine.shutdown()
