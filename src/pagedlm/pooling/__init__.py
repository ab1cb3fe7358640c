"""Pooling models: one vector per prompt (embeddings) instead of generated tokens.

``model_config.py`` picks the runner and the pooling, ``pooler.py`` pools on the worker,
``requests.py`` turns a prompt into an engine-core request, ``params.py`` holds the
per-request options and ``outputs.py`` what users get back.
"""

from pagedlm.pooling.outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
)
from pagedlm.pooling.params import PoolingParams

__all__ = [
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "PoolingOutput",
    "PoolingParams",
    "PoolingRequestOutput",
]
