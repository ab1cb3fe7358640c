"""Where a request's output starts, read from its rendered prompt: the one rule for the
server's reasoning parsers and for the engine's grammars that apply after the thought.

The last start or end marker of the prompt's current turn (``current_turn``: the text after
its last special token) decides: a start marker opened the thought (a chat template that
ends its generation prompt with ``<think>``, a prefill that goes on inside it), an end
marker closed it (thinking disabled, a prefill that ended the thought); a turn without a
marker keeps the family's rule (``ReasoningParser.starts_in_reasoning``). The server hands
the decisions to each choice's parser (``chat_output.reasoning_factory``), the engine's
input processor to each constrained request (``prompt_reasoning_ended``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedlm.entrypoints.openai.reasoning_parsers.abstract import (
    ReasoningParser,
    reasoning_ended_by_prompt,
)

PROMPT_TAIL_TOKENS = 1024
"""How many of the prompt's last tokens a reasoning parser may read: its current turn, cut
there (a template's turn is short; a prefill of a thought may not be)."""


def current_turn(
    parser_class: type[ReasoningParser], tokenizer: Any, prompt_token_ids: Sequence[int]
) -> str:
    """The prompt's text after its last special token (a role header, an end of turn), of
    at most ``PROMPT_TAIL_TOKENS`` tokens, special tokens kept: a marker the template put in
    the generation prompt or a prefill counts, one in an earlier message does not. A
    special token that is itself one of the parser's markers (``[THINK]``) is no
    boundary. No tokenizer or no prompt ids: "" (nothing known of the prompt)."""
    if tokenizer is None or not prompt_token_ids:
        return ""
    tail = list(prompt_token_ids[-PROMPT_TAIL_TOKENS:])
    special = _special_ids(tokenizer)
    for index in range(len(tail) - 1, -1, -1):
        if tail[index] in special:
            token = tokenizer.decode([tail[index]], skip_special_tokens=False)
            is_marker = parser_class.prompt_opens_reasoning(
                token
            ) or parser_class.prompt_closes_reasoning(token)
            if not is_marker:
                tail = tail[index + 1 :]
                break
    return tokenizer.decode(tail, skip_special_tokens=False)


def prompt_reasoning_ended(
    parser_class: type[ReasoningParser], tokenizer: Any, prompt_token_ids: Sequence[int]
) -> bool | None:
    """Whether the output of this prompt starts after the thought (True), inside one
    (False), or decides with its first token (None): ``reasoning_ended_by_prompt`` on the
    prompt's current turn."""
    return reasoning_ended_by_prompt(
        parser_class, current_turn(parser_class, tokenizer, prompt_token_ids)
    )


def _special_ids(tokenizer: Any) -> set[int]:
    """The tokenizer's special tokens: those it names (BOS, EOS, additional ones) and the
    added tokens it flags special (Llama 3's headers are not always named)."""
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special.update(i for i, token in added.items() if getattr(token, "special", False))
    return special
