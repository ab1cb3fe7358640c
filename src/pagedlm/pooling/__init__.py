"""Pooling models: one vector per prompt (embeddings, or a classifier's label
probabilities), or with the token-wise tasks one row per prompt token (per-token
embeddings, a token classifier's or reward model's scores), instead of generated tokens.

``model_config.py`` picks the runner and the pooling, ``tasks.py`` says which tasks a
model serves, ``pooler.py`` pools on the worker (``token_rows.py``: token-wise rows chunk
by chunk), ``requests.py`` turns a prompt (or a cross-encoder's text pair) into an
engine-core request, ``params.py`` holds the per-request options, ``scoring.py`` pairs
texts up and scores them, and ``outputs.py`` holds what users get back.
"""

from pagedlm.pooling.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagedlm.pooling.params import PoolingParams

__all__ = [
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "PoolingOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "ScoringOutput",
    "ScoringRequestOutput",
]
