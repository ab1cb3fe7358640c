"""Logprobs in the two OpenAI response shapes.

- Legacy completions: parallel lists ``tokens``, ``token_logprobs``, ``top_logprobs``
  (token text -> logprob) and ``text_offset`` (character offset of each token in the
  returned text). A prompt's first token has no logprob: ``None`` in both logprob lists.
- Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``.

Each position's dict (``dict[int, Logprob]``) holds the chosen token plus the top-k
candidates with ranks 1..k; ``num_top`` picks how many of those to report. With vLLM's
``return_tokens_as_token_ids`` every token is written ``"token_id:<id>"`` instead of its
text (tokens whose bytes are not valid UTF-8 on their own stay identifiable).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pagedlm.outputs import Logprob

PositionLogprobs = dict[int, Logprob] | None


MIN_LOGPROB = -9999.0
"""What an impossible token's ``-inf`` is written as (JSON has no infinity), as in vLLM."""


def _token_text(
    token_id: int, entry: Logprob | None, decode: Callable[[int], str], as_id: bool = False
) -> str:
    if as_id:
        return f"token_id:{token_id}"
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return decode(token_id)


@dataclass
class LegacyLogprobs:
    """Accumulates the legacy completions ``logprobs`` object, chunk by chunk."""

    num_top: int
    decode: Callable[[int], str]
    as_token_ids: bool = False
    next_offset: int = 0
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, token_ids: Sequence[int], positions: Sequence[PositionLogprobs]) -> None:
        for token_id, position in zip(token_ids, positions):
            entry = position.get(token_id) if position is not None else None
            text = _token_text(token_id, entry, self.decode, self.as_token_ids)
            self.tokens.append(text)
            self.text_offset.append(self.next_offset)
            self.next_offset += len(text)
            if position is None or entry is None:
                self.token_logprobs.append(None)
                self.top_logprobs.append(None)
                continue
            self.token_logprobs.append(max(entry.logprob, MIN_LOGPROB))
            top = {
                _token_text(tid, lp, self.decode, self.as_token_ids): max(lp.logprob, MIN_LOGPROB)
                for tid, lp in position.items()
                if tid == token_id or (lp.rank is not None and lp.rank <= self.num_top)
            }
            self.top_logprobs.append(top)

    def to_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }

    def take(self) -> dict:
        """The entries added since the last ``take`` (for one streamed chunk)."""
        chunk = self.to_dict()
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return chunk


def _chat_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": max(logprob, MIN_LOGPROB), "bytes": list(text.encode())}


def chat_logprobs(
    token_ids: Sequence[int],
    positions: Sequence[PositionLogprobs],
    num_top: int,
    decode: Callable[[int], str],
    as_token_ids: bool = False,
) -> list[dict]:
    """The ``content`` list of a chat choice's ``logprobs`` for these tokens."""
    content = []
    for token_id, position in zip(token_ids, positions):
        position = position or {}
        entry = position.get(token_id)
        text = _token_text(token_id, entry, decode, as_token_ids)
        item = _chat_entry(text, entry.logprob if entry is not None else float("-inf"))
        ranked = sorted(
            (
                (lp.rank, tid, lp)
                for tid, lp in position.items()
                if lp.rank is not None and lp.rank <= num_top
            ),
            key=lambda item: item[0],
        )
        item["top_logprobs"] = [
            _chat_entry(_token_text(tid, lp, decode, as_token_ids), lp.logprob)
            for _, tid, lp in ranked
        ]
        content.append(item)
    return content


def prompt_logprobs_json(prompt_logprobs: Sequence[PositionLogprobs]) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` field: per prompt position, token id -> logprob, rank and
    text (``None`` for the first position)."""
    return [
        None
        if position is None
        else {
            str(token_id): {
                "logprob": entry.logprob,
                "rank": entry.rank,
                "decoded_token": entry.decoded_token,
            }
            for token_id, entry in position.items()
        }
        for position in prompt_logprobs
    ]
