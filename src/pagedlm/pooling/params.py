"""``PoolingParams`` (vLLM's name): per-request options of a pooling request."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pagedlm.config import PoolerConfig
from pagedlm.pooling.tasks import check_task, default_task
from pagedlm.sampling_params import check_truncate_prompt_tokens


@dataclass(frozen=True)
class PoolingParams:
    """Embedding models: ``dimensions``, keep the first this many values (Matryoshka
    models only), then normalize; ``normalize`` (or ``use_activation``, vLLM's newer name
    for it), L2-normalize (None: the model's pooler config decides). Classifiers:
    ``use_activation``, turn the logits into probabilities or scores with the model's
    activation (None: yes; False: the raw logits). Both: ``truncate_prompt_tokens``, at
    most this many prompt tokens (-1: ``max_model_len``), a text cut by its tokenizer
    (which keeps the special tokens), token ids from the left.

    ``task`` (vLLM's): the pooling task (``pagedlm.pooling.tasks``; None: the model's
    own); ``LLM.encode(pooling_task=...)`` sets it. The token-wise tasks give one row per
    prompt token, each row treated as the sequence tasks treat their vector. With STEP
    pooling (``PoolerConfig.tok_pooling_type``) ``step_tag_id`` keeps only the rows of the
    positions holding that token and ``returned_token_ids`` only those columns (a reward
    head's labels), before the activation; None: the model's pooler config decides."""

    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None
    step_tag_id: int | None = None
    returned_token_ids: list[int] | None = None
    task: str | None = None

    def with_task(self, task: str) -> PoolingParams:
        """These parameters for ``task``; an error if they name another one (vLLM's)."""
        if self.task == task:
            return self
        if self.task is not None:
            raise ValueError(
                f"These PoolingParams have task={self.task!r}, which pooling_task={task!r} "
                "cannot overwrite; pass PoolingParams without a task, or the same one."
            )
        return dataclasses.replace(self, task=task)

    def resolved_task(self, pooler: PoolerConfig) -> str:
        """The task these parameters run: theirs, else the model's own."""
        return default_task(pooler) if self.task is None else self.task

    def step_tag(self, pooler: PoolerConfig) -> int | None:
        """The token whose positions STEP pooling keeps (None: every position, or not
        STEP pooling)."""
        if pooler.tok_pooling_type != "STEP":
            return None
        return pooler.step_tag_id if self.step_tag_id is None else self.step_tag_id

    def validate(self, pooler: PoolerConfig, hidden_size: int) -> None:
        """Raise ``ValueError`` naming the fix when the model cannot honour these."""
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        task = self.resolved_task(pooler)
        check_task(pooler, task)
        self._check_step_fields(pooler, task, hidden_size)
        if pooler.labels is not None:
            for name in ("dimensions", "normalize"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"{name} applies to embedding models; this one is a classifier "
                        f"({len(pooler.labels)} labels). Omit {name}, or pass "
                        "use_activation=False for the raw logits."
                    )
            return
        if None not in (self.use_activation, self.normalize) and (
            self.use_activation != self.normalize
        ):
            raise ValueError(
                f"use_activation={self.use_activation} and normalize={self.normalize} "
                "disagree; for an embedding model both say whether it is L2-normalized "
                "(vLLM's newer and older names): pass one."
            )
        self._check_dimensions(pooler, hidden_size)

    def _check_step_fields(self, pooler: PoolerConfig, task: str, hidden_size: int) -> None:
        given = [n for n in ("step_tag_id", "returned_token_ids") if getattr(self, n) is not None]
        if not given:
            return
        if not task.startswith("token_") or pooler.tok_pooling_type != "STEP":
            raise ValueError(
                f"{' and '.join(given)} apply to STEP pooling of the token-wise tasks (process "
                f"reward models); this request runs {task!r} and the model pools token-wise "
                f"with {pooler.tok_pooling_type!r}. Omit them, or start the engine with "
                "pooler_config={'tok_pooling_type': 'STEP'} and run 'token_classify' (or "
                "'token_embed' on an embedding model)."
            )
        step_tag_id = self.step_tag_id
        if step_tag_id is not None and (
            isinstance(step_tag_id, bool) or not isinstance(step_tag_id, int) or step_tag_id < 0
        ):
            raise ValueError(
                f"step_tag_id must be a token id (an integer >= 0), got {step_tag_id!r}."
            )
        columns = self.returned_token_ids
        if columns is None:
            return
        width = hidden_size if pooler.labels is None else len(pooler.labels)
        if not isinstance(columns, list) or not all(
            isinstance(c, int) and not isinstance(c, bool) and 0 <= c < width for c in columns
        ):
            raise ValueError(
                f"returned_token_ids must be a list of column indices in [0, {width}) (the "
                f"model's {'labels' if pooler.labels else 'hidden size'}), got {columns!r}."
            )

    def _check_dimensions(self, pooler: PoolerConfig, hidden_size: int) -> None:
        dims = self.dimensions
        if dims is None:
            return
        if isinstance(dims, bool) or not isinstance(dims, int) or dims < 1:
            raise ValueError(f"dimensions must be a positive integer, got {dims!r}.")
        if not pooler.is_matryoshka:
            if dims == hidden_size:
                return
            raise ValueError(
                f"dimensions={dims} needs a Matryoshka model, and this one is not (its "
                f"config.json has no is_matryoshka / matryoshka_dimensions); omit dimensions "
                f"to get all {hidden_size}."
            )
        allowed = pooler.matryoshka_dimensions
        if allowed is not None and dims not in allowed:
            raise ValueError(
                f"dimensions={dims} is not one this model was trained for; use one of "
                f"{sorted(allowed)}."
            )
        if dims > hidden_size:
            raise ValueError(f"dimensions={dims} exceeds the model's {hidden_size} dimensions.")

    def finish(self, pooled: Any, pooler: PoolerConfig) -> torch.Tensor:
        """The user's output from the engine's raw one (float32: a vector, or a token-wise
        task's rows, each row treated alike). Embeddings: cut to ``dimensions``, then
        normalized when asked. Classifiers: the logits through the model's activation
        unless ``use_activation=False``. STEP pooling keeps the ``returned_token_ids``
        columns of either token-wise task first."""
        data = torch.as_tensor(pooled, dtype=torch.float32)
        task = self.resolved_task(pooler)
        if task.startswith("token_"):  # STEP pooling keeps its columns first, as vLLM's
            columns = self._returned_columns(pooler)
            if columns:
                data = data[:, columns]
        if pooler.labels is not None:
            return self._activate(data, pooler, token_wise=task == "token_classify")
        if self.dimensions is not None:
            data = data[..., : self.dimensions]
        asked = self.normalize if self.normalize is not None else self.use_activation
        normalize = pooler.normalize if asked is None else asked
        return F.normalize(data, p=2, dim=-1) if normalize else data

    def _returned_columns(self, pooler: PoolerConfig) -> list[int] | None:
        if pooler.tok_pooling_type != "STEP":
            return None
        if self.returned_token_ids is not None:
            return self.returned_token_ids
        return None if pooler.returned_token_ids is None else list(pooler.returned_token_ids)

    def _activate(
        self, logits: torch.Tensor, pooler: PoolerConfig, token_wise: bool
    ) -> torch.Tensor:
        """The model's activation over the last dimension; token-wise, over the columns
        kept, one of which gets a sigmoid (vLLM's rule for a head read per token)."""
        if self.use_activation is False or pooler.activation == "identity":
            return logits
        if pooler.activation == "sigmoid" or (token_wise and logits.shape[-1] < 2):
            return logits.sigmoid()
        return logits.softmax(-1)
