"""Logprobs: ``LogprobsLists`` rows from the engine core -> ``dict[int, Logprob]`` per position.

A row is ``token_ids = [chosen, top_1, ..., top_k]`` with matching ``logprobs`` and the
chosen token's ``rank`` (1 = most likely). The chosen token is the sampled one for sample
logprobs and the actual next prompt token for prompt logprobs. It keeps its own rank in
the dict; the top-k entries get ranks 1..k (when the chosen token is among them both
entries agree, so the dict simply holds it once).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pagedlm.engine.detokenizer import tokenizers_backend
from pagedlm.outputs import Logprob, PromptLogprobs, SampleLogprobs
from pagedlm.sampling_params import SamplingParams
from pagedlm.step import LogprobsLists


class TokenTextCache:
    """Each token id's text on its own (``Logprob.decoded_token``), decoded in batches.

    Special tokens are kept ("<|endoftext|>"), as a user inspecting candidates wants to
    see them. A byte-level token that is part of a multi-byte character decodes as
    "\\ufffd", as in vLLM. Memory is bounded by the vocabulary size.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._backend = tokenizers_backend(tokenizer)
        self._texts: dict[int, str] = {}

    def prefetch(self, token_ids: Iterable[int]) -> None:
        """Decode every id not seen yet in one batched call."""
        missing = sorted({tid for tid in token_ids if tid not in self._texts})
        if not missing:
            return
        batch = [[tid] for tid in missing]
        try:
            if self._backend is not None:
                texts = self._backend.decode_batch(batch, skip_special_tokens=False)
            else:
                texts = self.tokenizer.batch_decode(batch, skip_special_tokens=False)
        except (OverflowError, TypeError, ValueError):
            # One bad id (negative, too large) must not cost the others their text.
            texts = [self._decode_one(tid) for tid in missing]
        self._texts.update(zip(missing, texts, strict=True))

    def get(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._decode_one(token_id)
        return text

    def _decode_one(self, token_id: int) -> str:
        try:
            if self._backend is not None:
                return self._backend.decode([token_id], skip_special_tokens=False)
            return self.tokenizer.decode([token_id], skip_special_tokens=False)
        except (OverflowError, TypeError, ValueError):
            return ""


def logprobs_row_to_dict(
    token_ids: list[int], logprobs: list[float], rank: int, texts: TokenTextCache | None
) -> dict[int, Logprob]:
    """One position's candidates: the chosen token with ``rank``, the rest ranked 1..k."""

    def text(token_id: int) -> str | None:
        return None if texts is None else texts.get(token_id)

    chosen = token_ids[0]
    row = {chosen: Logprob(logprobs[0], rank, text(chosen))}
    for top_rank, (token_id, logprob) in enumerate(
        zip(token_ids[1:], logprobs[1:], strict=True), start=1
    ):
        if token_id != chosen:
            row[token_id] = Logprob(logprob, top_rank, text(token_id))
    return row


def row_token_ids(lists: LogprobsLists | None) -> Iterable[int]:
    """Every id in ``lists`` (for ``TokenTextCache.prefetch``)."""
    if lists is not None:
        for ids in lists.token_ids:
            yield from ids


class LogprobsProcessor:
    """Sample and prompt logprobs of one completion, accumulated step by step.

    Invariant: ``len(logprobs) == number of kept output tokens`` when sample logprobs
    were requested; ``prompt_rows`` holds positions 1..len(rows) of the prompt in order.
    """

    def __init__(self, params: SamplingParams, texts: TokenTextCache | None) -> None:
        self.texts = texts
        self.wants_logprobs = params.logprobs is not None
        self.wants_prompt_logprobs = params.prompt_logprobs is not None
        self.logprobs: SampleLogprobs | None = [] if self.wants_logprobs else None
        self.cumulative_logprob: float | None = 0.0 if self.wants_logprobs else None
        self.prompt_rows: list[dict[int, Logprob]] = []

    def add_sample_rows(self, lists: LogprobsLists | None, num_tokens: int, req_id: str) -> None:
        """Append the rows of the first ``num_tokens`` new tokens (later tokens were
        dropped after a stop string)."""
        if not self.wants_logprobs or num_tokens == 0:
            return
        if lists is None or len(lists.token_ids) < num_tokens:
            num_rows = 0 if lists is None else len(lists.token_ids)
            raise ValueError(
                f"Request {req_id!r} asked for logprobs but the engine core sent {num_rows} "
                f"logprob rows for {num_tokens} new tokens; the model runner must return a "
                "row for every sampled token."
            )
        assert self.logprobs is not None and self.cumulative_logprob is not None
        for i in range(num_tokens):
            row = logprobs_row_to_dict(
                lists.token_ids[i], lists.logprobs[i], lists.ranks[i], self.texts
            )
            self.logprobs.append(row)
            self.cumulative_logprob += lists.logprobs[i][0]

    def add_prompt_rows(self, lists: LogprobsLists | None) -> None:
        """Append the next chunk of prompt positions (chunked prefill sends several)."""
        if lists is None or not self.wants_prompt_logprobs:
            return
        for ids, logprobs, rank in zip(lists.token_ids, lists.logprobs, lists.ranks, strict=True):
            self.prompt_rows.append(logprobs_row_to_dict(ids, logprobs, rank, self.texts))

    def prompt_logprobs(self) -> PromptLogprobs | None:
        """``[None]`` (nothing predicts the first token) followed by the rows so far."""
        if not self.wants_prompt_logprobs:
            return None
        return [None, *self.prompt_rows]
