"""Which pooling tasks a model serves (vLLM's names), and the errors that name the fix.

A model embeds or classifies (``PoolerConfig.labels``); either way it may pool whole
prompts ("embed", or "classify" and for one label "score") and pools token-wise
("token_embed": every prompt token's hidden state; "token_classify": the head's logits at
every token), as vLLM's ``DispatchPooler`` serves them. Models whose head reads every
token (``*ForTokenClassification``, reward models: ``sequence_pooling=False``) serve
"token_classify" only. An embedding model scores by cosine similarity ("score").
"""

from __future__ import annotations

from pagedlm.config import PoolerConfig
from pagedlm.step.pooling import TOKEN_TASKS

POOLING_TASKS = ("embed", "classify", "score", *TOKEN_TASKS)


def supported_tasks(pooler: PoolerConfig) -> tuple[str, ...]:
    """The tasks this pooling model serves, its default ("the model's own") first."""
    if pooler.labels is None:
        return ("embed", "token_embed", "score") if pooler.sequence_pooling else ("token_embed",)
    if not pooler.sequence_pooling:
        return ("token_classify",)
    if len(pooler.labels) == 1:
        return ("classify", "token_classify", "score")
    return ("classify", "token_classify")


def default_task(pooler: PoolerConfig) -> str:
    """The task of a request that names none: the model's own."""
    return supported_tasks(pooler)[0]


_HINTS = {
    "embed": "use LLM.embed() or /v1/embeddings",
    "classify": "use LLM.classify() or /classify",
    "score": "use LLM.score(), /score or /rerank",
    "token_embed": "use LLM.encode(pooling_task='token_embed') or /pooling with task 'token_embed'",
    "token_classify": "use LLM.reward(), LLM.encode(pooling_task='token_classify') or "
    "/pooling with task 'token_classify'",
}


def check_task(pooler: PoolerConfig | None, task: str) -> None:
    """Raise ``ValueError`` naming the fix (and the tasks the model serves) when the
    pooling model cannot run ``task``."""
    if task not in POOLING_TASKS:
        raise ValueError(
            f"pooling task {task!r} is unknown; use one of {list(POOLING_TASKS)} (or None "
            "for the model's own)."
        )
    if pooler is None:
        raise ValueError(
            f"{task} needs a pooling model (an embedding model or a classifier); this one "
            "generates. Load one with runner='pooling' (--runner pooling)."
        )
    served = supported_tasks(pooler)
    if task in served:
        return
    what = _what_it_is(pooler)
    others = "; ".join(f"for {t}, {_HINTS[t]}" for t in served)
    if task == "score" and pooler.labels is not None and pooler.sequence_pooling:
        what = (
            f"Scoring needs a cross-encoder (a classifier with one label) or an embedding "
            f"model; this classifier has {len(pooler.labels)} labels"
        )
    raise ValueError(f"{what}. It serves the tasks {list(served)}: {others}.")


def _what_it_is(pooler: PoolerConfig) -> str:
    labels = pooler.labels
    if labels is None:
        if not pooler.sequence_pooling:
            return "This model embeds every token only and does not pool whole prompts"
        return "This model embeds and does not classify"
    if not pooler.sequence_pooling:
        return (
            f"This model classifies every token ({len(labels)} labels: a token classifier or "
            "reward model) and does not embed or pool whole prompts"
        )
    return f"This model is a classifier ({len(labels)} labels) and does not embed"
