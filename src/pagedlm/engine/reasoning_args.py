"""vLLM's ``structured_outputs_config.reasoning_parser`` (the server's ``--reasoning-parser``
sets it), ``reasoning_parser_plugin`` and ``enable_in_reasoning`` -> the thought's markers
as token ids (``config.ReasoningMarkers``), checked at the edge.

With a reasoning parser and ``enable_in_reasoning`` off (vLLM's default), a constrained
request thinks freely and its grammar applies to the tokens after the thought's end marker.
The engine needs only the markers, as tokens: each spelling of the parser's
``start_tags``/``end_tags`` that is one token of the model's tokenizer. A parser with no
end marker of one token (``granite``'s sentences, ``openai_gptoss``'s channels, a tokenizer
without ``</think>``) leaves grammars applying from the first token, as with
``enable_in_reasoning``; that is logged once.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from pagedlm.config import ReasoningMarkers

if TYPE_CHECKING:
    from pagedlm.config import ModelConfig

logger = logging.getLogger(__name__)

REASONING_KEYS = ("reasoning_parser", "reasoning_parser_plugin", "enable_in_reasoning")
"""The ``structured_outputs_config`` keys this module reads."""


def check_reasoning_keys(config: dict[str, Any]) -> None:
    """The reasoning keys' types, each error naming its key."""
    for name in ("reasoning_parser", "reasoning_parser_plugin"):
        if not isinstance(config.get(name, ""), str):
            raise ValueError(
                f"structured_outputs_config.{name} must be a string, got {config[name]!r}."
            )
    if not isinstance(config.get("enable_in_reasoning", False), bool):
        raise ValueError(
            "structured_outputs_config.enable_in_reasoning must be true or false, got "
            f"{config['enable_in_reasoning']!r}."
        )


def merge_reasoning_fields(args: Any) -> dict[str, Any] | None:
    """vLLM's ``reasoning_parser`` and ``reasoning_parser_plugin`` engine arguments (the
    CLI's ``--reasoning-parser``) are shorthands for the ``structured_outputs_config`` keys
    of the same names: either spelling sets both (on ``args`` too); two different values
    are refused naming both. Returns the merged ``structured_outputs_config``."""
    config = args.structured_outputs_config
    if config is not None and not isinstance(config, dict):
        return config  # refused with the rest of its checks (structured_outputs_args.py)
    for key in ("reasoning_parser", "reasoning_parser_plugin"):
        given = getattr(args, key) or ""
        if not isinstance(given, str):
            raise ValueError(f"{key} must be a parser's name (a string), got {given!r}.")
        configured = (config or {}).get(key) or ""
        if given and configured and given != configured:
            raise ValueError(
                f"{key}={given!r} and structured_outputs_config's {key} {configured!r} "
                "name two; pass one."
            )
        if given or configured:
            setattr(args, key, given or configured)
            config = {**(config or {}), key: given or configured}
    return config


def reasoning_markers(
    config: dict[str, Any] | None, model: ModelConfig, log: bool = True
) -> ReasoningMarkers | None:
    """The markers after which grammars apply, or None (from the first token): no
    ``reasoning_parser``, ``enable_in_reasoning``, no tokenizer, or no end marker of one
    token (logged when ``log``)."""
    config = dict(config or {})
    check_reasoning_keys(config)
    name = config.get("reasoning_parser") or ""
    if not name:
        return None
    parser_class = reasoning_parser_class(name, config.get("reasoning_parser_plugin") or "")
    if config.get("enable_in_reasoning") or model.skip_tokenizer_init:
        return None
    from pagedlm.tokenizer import model_tokenizer

    tokenizer = model_tokenizer(model)
    start = single_token_ids(tokenizer, parser_class.start_tags)
    end = single_token_ids(tokenizer, parser_class.end_tags)
    if not end:
        if log:
            spelled = list(parser_class.end_tags) or "none"
            logger.warning(
                "Reasoning parser %r: its end marker (%s) is no single token of this "
                "tokenizer, so the engine cannot tell where a thought ends: grammars apply "
                "from the first output token, and a constrained output is the answer.",
                name,
                spelled,
            )
        return None
    # Only where the output's first token may decide (a start marker of one token, and a
    # family that does not start inside the thought) does leading whitespace matter.
    undecided = bool(start) and not parser_class.starts_in_reasoning
    whitespace = whitespace_token_ids(tokenizer) if undecided else frozenset()
    return ReasoningMarkers(name, start, end, whitespace)


def reasoning_parser_class(name: str, plugin: str = "") -> Any:
    """The reasoning parser registered as ``name``, after importing ``plugin`` (a ``.py``
    file or module that registers parsers); ValueError naming the known ones."""
    from pagedlm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS

    if plugin:
        from pagedlm.entrypoints.openai.parser_plugins import load_plugin

        try:
            load_plugin(plugin, "structured_outputs_config.reasoning_parser_plugin")
        except SystemExit as error:
            raise ValueError(str(error).removeprefix("error: ")) from None
    parser_class = REASONING_PARSERS.get(name)
    if parser_class is None:
        raise ValueError(
            f"structured_outputs_config.reasoning_parser {name!r} is unknown; choose one of "
            f"{sorted(REASONING_PARSERS)}, or register it in a file given as "
            "reasoning_parser_plugin (--reasoning-parser-plugin)."
        )
    return parser_class


def single_token_ids(tokenizer: Any, spellings: tuple[str, ...]) -> tuple[int, ...]:
    """The ids of the spellings that are one token each (encoded alone, and decoded back
    to themselves), in order, without repeats."""
    ids: list[int] = []
    for text in spellings:
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) != 1:
            continue
        decoded = tokenizer.decode(encoded, skip_special_tokens=False)
        if decoded == text and encoded[0] not in ids:
            ids.append(encoded[0])
    return tuple(ids)


def whitespace_token_ids(tokenizer: Any) -> frozenset[int]:
    """The tokens whose text, decoded alone with special tokens kept, is only whitespace
    (the characters ``str.lstrip`` removes, as the reasoning parsers do) or nothing."""
    ids = [[token_id] for token_id in range(len(tokenizer))]
    backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer's Rust side
    if backend is not None:
        texts = backend.decode_batch(ids, skip_special_tokens=False)  # 0.3 s for 150k
    else:
        texts = [tokenizer.decode(one, skip_special_tokens=False) for one in ids]
    return frozenset(i for i, text in enumerate(texts) if not text.strip())
