"""``PoolingParams`` (vLLM's name): per-request options of a pooling request."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedlm.config import PoolerConfig
from pagedlm.sampling_params import check_truncate_prompt_tokens


@dataclass(frozen=True)
class PoolingParams:
    """Embedding models: ``dimensions``, keep the first this many values (Matryoshka
    models only), then normalize; ``normalize`` (or ``use_activation``, vLLM's newer name
    for it), L2-normalize (None: the model's pooler config decides). Classifiers: ``use_activation``, turn the logits into probabilities
    or scores with the model's activation (None: yes; False: the raw logits). Both:
    ``truncate_prompt_tokens``, at most this many prompt tokens (-1: ``max_model_len``),
    a text cut by its tokenizer (which keeps the special tokens), token ids from the left."""

    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None

    def validate(self, pooler: PoolerConfig, hidden_size: int) -> None:
        """Raise ``ValueError`` naming the fix when the model cannot honour these."""
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
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

    def finish(self, pooled: list[float], pooler: PoolerConfig) -> torch.Tensor:
        """The user's vector from the engine's raw one (float32). Embeddings: cut to
        ``dimensions``, then normalized when asked. Classifiers: the logits through the
        model's activation unless ``use_activation=False``."""
        vector = torch.tensor(pooled, dtype=torch.float32)
        if pooler.labels is not None:
            if self.use_activation is False or pooler.activation == "identity":
                return vector
            return vector.sigmoid() if pooler.activation == "sigmoid" else vector.softmax(-1)
        if self.dimensions is not None:
            vector = vector[: self.dimensions]
        asked = self.normalize if self.normalize is not None else self.use_activation
        normalize = pooler.normalize if asked is None else asked
        return F.normalize(vector, p=2, dim=-1) if normalize else vector
