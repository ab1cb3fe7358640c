"""The worker's pooler: one vector per finished prompt from a step's hidden states.

Invariant it relies on: the pooling runner schedules whole prompts (``whole_prompts``), so
a request that finishes its prompt in a step has every token it did not take from the
prefix cache among that step's rows, ``query_start_loc[i] .. query_start_loc[i + 1] - 1``;
only last-token pooling over causal attention takes any (``caches_prefixes``), and the
last token is always computed.
Normalization and ``dimensions`` are per request and applied by the front end
(``PoolingParams.finish``), so what travels back is the raw pooled vector; a classifier's
is its head's logits (``classifier_logits``: pooled hidden states in the model's dtype ->
[num_pooled, num_labels]), the activation again left to the front end.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from pagedlm.config import POOLING_TYPES, ModelConfig
from pagedlm.step import ModelRunnerOutput

Head = Callable[[torch.Tensor], torch.Tensor]


class Pooler:
    """hidden states [num_tokens, hidden] -> [num_pooled, hidden] float32 vectors, or
    [num_pooled, num_labels] logits through a classifier's ``head``."""

    def __init__(self, pooling_type: str, head: Head | None = None) -> None:
        if pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling type {pooling_type!r} is unknown; use one of {list(POOLING_TYPES)}."
            )
        self.pooling_type = pooling_type
        self.head = head

    def __call__(
        self, hidden: torch.Tensor, query_start_loc: np.ndarray, rows: np.ndarray
    ) -> torch.Tensor:
        """Pool requests ``rows`` (batch indices) of the step; ``query_start_loc``
        [num_reqs + 1] host offsets of each request's rows in ``hidden``."""
        pooled = self._pool(hidden, query_start_loc, rows)
        if self.head is None:
            return pooled
        return self.head(pooled.to(hidden.dtype)).float()

    def _pool(
        self, hidden: torch.Tensor, query_start_loc: np.ndarray, rows: np.ndarray
    ) -> torch.Tensor:
        if len(rows) == 0:
            return hidden.new_zeros(0, hidden.shape[1], dtype=torch.float32)
        starts = query_start_loc[rows].astype(np.int64)
        ends = query_start_loc[rows + 1].astype(np.int64)
        device = hidden.device
        if self.pooling_type == "LAST":
            return hidden.index_select(0, torch.from_numpy(ends - 1).to(device)).float()
        if self.pooling_type == "CLS":
            return hidden.index_select(0, torch.from_numpy(starts).to(device)).float()
        # MEAN: one index_add over every pooled row, each row tagged with its request.
        lengths = ends - starts
        token_rows = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends, strict=True)])
        owners = np.repeat(np.arange(len(rows)), lengths)
        sums = torch.zeros(len(rows), hidden.shape[1], dtype=torch.float32, device=device)
        values = hidden.index_select(0, torch.from_numpy(token_rows).to(device)).float()
        sums.index_add_(0, torch.from_numpy(owners).to(device), values)
        return sums / torch.from_numpy(lengths).to(device, torch.float32)[:, None]


class PooledStep:
    """A pooling step's handle: ``result()`` waits for its vectors and reports them as
    ``pooler_output`` (every scheduled request samples nothing)."""

    def __init__(self, req_ids: list[str], pooled_ids: list[str], pooled: torch.Tensor) -> None:
        self.req_ids = req_ids
        self.pooled_ids = pooled_ids
        self.pooled = pooled

    def result(self) -> ModelRunnerOutput:
        rows = self.pooled.cpu().tolist()
        return ModelRunnerOutput(
            req_ids=self.req_ids,
            sampled_token_ids=[[] for _ in self.req_ids],
            pooler_output=dict(zip(self.pooled_ids, rows, strict=True)),
        )


def make_pooler(model_config: ModelConfig, model: nn.Module) -> Pooler | None:
    """The pooler of a pooling runner (a classifier's with ``model``'s head); None for a
    generating one."""
    if model_config.runner != "pooling":
        return None
    config = model_config.pooler
    assert config is not None, "a pooling model config has a pooler"
    head = None
    if config.labels is not None:
        head = getattr(model, "classifier_logits", None)
        if head is None:
            raise ValueError(
                f"{type(model).__name__} has no classification head, but its config names "
                f"{len(config.labels)} labels."
            )
    return Pooler(config.pooling_type, head)
