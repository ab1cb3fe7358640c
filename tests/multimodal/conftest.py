"""One tiny LLaVA checkpoint and transformers' model for the whole multimodal test run."""

from __future__ import annotations

import pytest
from tiny_llava import save_tiny_llava


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory):
    """(checkpoint directory, transformers' model)."""
    path = tmp_path_factory.mktemp("tiny_llava")
    return path, save_tiny_llava(path)
