"""``GET /tokenizer_info`` (vLLM's, behind ``--enable-tokenizer-info-endpoint``): the
tokenizer's configuration as JSON, so a client can tokenize as the server does.

It is what the tokenizer was built with (transformers' ``init_kwargs``, file paths left
out), its class, size and special tokens, the chat template the server renders with, and
the server's ``max_model_len`` as ``model_max_length``. Off by default, as in vLLM:
templates may be private to the deployment.
"""

from __future__ import annotations

from typing import Any

_FILE_KEYS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")


def tokenizer_info(tokenizer: Any, chat_template: str | None) -> dict[str, Any]:
    config = {
        key: value
        for key, value in (getattr(tokenizer, "init_kwargs", None) or {}).items()
        if key not in _FILE_KEYS
    }
    for name, token in getattr(tokenizer, "special_tokens_map", {}).items():
        config.setdefault(name, token)
    config["tokenizer_class"] = type(tokenizer).__name__
    config["vocab_size"] = len(tokenizer)
    config.setdefault("eos_token_id", getattr(tokenizer, "eos_token_id", None))
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template:
        config["chat_template"] = template
    return _json_safe(config)


def _json_safe(value: Any) -> Any:
    """``value`` with every part JSON can hold: an ``AddedToken`` as its text, anything
    else unknown as its ``str``."""
    if isinstance(value, dict):
        return {str(key): _json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple | set):
        return [_json_safe(item) for item in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    content = getattr(value, "content", None)  # tokenizers' AddedToken
    return content if isinstance(content, str) else str(value)
