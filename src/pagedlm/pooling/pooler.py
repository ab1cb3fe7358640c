"""The worker's pooler: a step's hidden states -> each pooling request's output.

Sequence tasks (embed, classify, score): one vector per request whose prompt ends in the
step, LAST/MEAN/CLS over its rows (``Pooler``). What that relies on: MEAN and CLS pooling
and encoders run whole prompts (``whole_prompts``), so such a request has every token it
did not take from the prefix cache among the step's rows, ``query_start_loc[i] ..
query_start_loc[i + 1] - 1``; LAST reads only the last row, which is always computed, so
its prompts may come in chunks and from the prefix cache (``caches_prefixes``).

Token-wise tasks (token_embed, token_classify): every chunk of the prompt gives its rows
(STEP pooling: those of the positions holding the step tag) in the step that computes
it; they go through the head at once and start copying to host memory, and when the
prompt ends its host rows are joined (``TokenPooler``). Such a request never reads the
prefix cache, so chunk by chunk its rows cover the whole prompt.

Normalization, ``dimensions`` and activations are per request and applied by the front
end (``PoolingParams.finish``), so what travels back is raw: a vector, a classifier's
logits (``classifier_logits``: hidden states in the model's dtype -> [n, num_labels]), or
a token-wise task's float32 rows.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from pagedlm.config import POOLING_TYPES, ModelConfig
from pagedlm.pooling.outputs import as_tensor_data
from pagedlm.pooling.tasks import default_task
from pagedlm.pooling.token_rows import TokenPooler
from pagedlm.step import ModelRunnerOutput, SchedulerOutput, TensorData
from pagedlm.worker.launched_step import copy_to_host

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
    """A pooling step's handle: ``result()`` waits for its copies to the host and reports
    the requests whose prompt ended as ``pooler_output`` (every scheduled request samples
    nothing). ``vectors``: the sequence tasks' host rows, one per ``vector_ids`` entry;
    ``token_rows``: a token-wise request's host chunks, in prompt order."""

    def __init__(
        self,
        req_ids: list[str],
        vector_ids: list[str],
        vectors: torch.Tensor | None,
        token_rows: dict[str, list[torch.Tensor]],
        copied: torch.Event | None,
    ) -> None:
        self.req_ids = req_ids
        self.vector_ids = vector_ids
        self.vectors = vectors
        self.token_rows = token_rows
        self._copied = copied

    def result(self) -> ModelRunnerOutput:
        if self._copied is not None:
            self._copied.synchronize()  # the step's copies, and every earlier chunk's
        pooler_output: dict[str, list[float] | TensorData] = {}
        if self.vectors is not None:
            pooler_output.update(zip(self.vector_ids, self.vectors.tolist(), strict=True))
        for req_id, chunks in self.token_rows.items():
            pooler_output[req_id] = as_tensor_data(torch.cat(chunks))
        return ModelRunnerOutput(
            req_ids=self.req_ids,
            sampled_token_ids=[[] for _ in self.req_ids],
            pooler_output=pooler_output,
        )


class RequestPooler:
    """The pooling runner's pooler: ``update`` with every step's ``SchedulerOutput`` (in
    order), then ``pool`` each step that runs a forward."""

    def __init__(self, sequence: Pooler, tokens: TokenPooler) -> None:
        self.sequence = sequence
        self.tokens = tokens

    def update(self, scheduler_output: SchedulerOutput) -> None:
        self.tokens.update(scheduler_output)

    def pool(
        self,
        hidden: torch.Tensor,
        req_ids: list[str],
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
        finishing: np.ndarray,
    ) -> PooledStep:
        """The step's outputs: ``hidden`` [num_tokens, hidden] of the requests
        ``req_ids`` (rows ``query_start_loc[i] ..``, each request's tokens ending at
        position ``seq_lens[i] - 1``); ``finishing``: the batch indices whose prompt ends."""
        chunks = self.tokens.gather(hidden, req_ids, query_start_loc, seq_lens)
        sequence_rows = np.asarray(
            [i for i in finishing if req_ids[i] not in self.tokens], dtype=np.int64
        )
        tensors = [] if chunks is None else [chunks.values]
        vectors = None
        if len(sequence_rows):
            vectors = self.sequence(hidden, query_start_loc, sequence_rows)
            tensors.append(vectors)
        host, copied = copy_to_host(tensors) if tensors else ([], None)
        if vectors is not None:
            vectors = host[-1]
        token_rows = {}
        if chunks is not None:
            token_rows = self.tokens.keep(chunks, host[0], [req_ids[i] for i in finishing])
        vector_ids = [req_ids[i] for i in sequence_rows]
        return PooledStep(req_ids, vector_ids, vectors, token_rows, copied)


def make_pooler(model_config: ModelConfig, model: nn.Module) -> RequestPooler | None:
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
    # A head whose sequence form differs per token (BERT's pooler layer) names its own.
    token_head = getattr(model, "token_classifier_logits", head)
    return RequestPooler(
        Pooler(config.pooling_type, head), TokenPooler(token_head, default_task(config))
    )
