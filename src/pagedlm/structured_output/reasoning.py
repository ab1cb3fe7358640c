"""Where a constrained request's grammar starts: after the model's thought
(``config.ReasoningMarkers``, vLLM's ``structured_outputs_config.reasoning_parser``).

A request is in one of three states (``Request.reasoning_ended``, read from its prompt by
the input processor, then moved by each token it generates):

- True: the answer. Every token is the grammar's: masked by it, and advancing it.
- False: inside a thought. Tokens are free and the grammar does not see them; an end
  marker (free too) ends the thought, and the grammar governs the next token.
- None: the next token decides. A start marker opens a thought (False); a token of only
  whitespace leaves it undecided (None: the reasoning parsers skip leading whitespace
  before looking for the start marker, so a newline then ``<think>`` opens a thought
  there too), free and unseen by the grammar (it stays in the answer's text, before what
  the grammar governs); any other token is the answer's first (True). That token's mask
  is the grammar's plus the start markers.

Only the scheduler's side knows these states; the workers get a bitmask row per sampled
position as always, all ones (-1) where the position is free.
"""

from __future__ import annotations

import numpy as np

from pagedlm.config import ReasoningMarkers

ReasoningState = bool | None
"""True: the answer; False: inside a thought; None: the next token decides."""


def after_token(
    markers: ReasoningMarkers, state: ReasoningState, token_id: int
) -> tuple[ReasoningState, bool]:
    """(the state after ``token_id``, whether the grammar governs ``token_id``)."""
    if state is True:
        return True, True
    if state is False:
        return token_id in markers.end_token_ids, False
    if token_id in markers.start_token_ids:
        return False, False
    if token_id in markers.whitespace_token_ids:
        return None, False
    return True, True


def answer_start(
    markers: ReasoningMarkers | None, state: ReasoningState, token_ids: list[int]
) -> tuple[ReasoningState, int]:
    """(the state after ``token_ids``, the index of the first of them the grammar governs,
    ``len(token_ids)`` if none): tokens that follow each other in one output."""
    if markers is None or state is True:
        return True, 0
    for index, token_id in enumerate(token_ids):
        state, governed = after_token(markers, state, token_id)
        if governed:
            return True, index
        if state is True:
            return True, index + 1
    return state, len(token_ids)


def allow_tokens(bitmask: np.ndarray, row: int, token_ids: tuple[int, ...]) -> None:
    """Set the bits of ``token_ids`` in ``bitmask[row]`` (xgrammar's layout: bit ``j`` of
    word ``w`` is token ``32 * w + j``)."""
    words = bitmask[row].view(np.uint32)
    for token_id in token_ids:
        if token_id // 32 < words.shape[0]:
            words[token_id // 32] |= np.uint32(1 << (token_id % 32))
