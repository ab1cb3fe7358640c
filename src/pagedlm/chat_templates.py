"""Render a Jinja chat template the way ``transformers``' ``apply_chat_template`` does.

Tokenizers built without transformers (``gguf_tokenizer``) render their templates here, so
that a prompt is the same text whichever tokenizer class holds the template. What we
reproduce, because templates depend on it: a sandboxed environment with ``trim_blocks``
and ``lstrip_blocks``, the ``loopcontrols`` extension and a ``{% generation %}`` block that
renders its body; the ``tojson`` filter without HTML escaping (with ``indent``,
``separators``, ``sort_keys``), ``raise_exception``, ``strftime_now``, a ``dict`` callable
and a ``namespace`` that refuses underscore names; messages as plain dicts without the keys
set to None, and the reasoning under its three names (``reasoning_content``, ``thinking``,
``reasoning``); the special tokens as template variables; ``continue_final_message``
cutting the text after the last message. Not reproduced: tools given as Python functions
(pass JSON schemas) and the assistant-token mask.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
"""Appended to the message being continued, to find where it ends in the rendered text."""


@functools.lru_cache(maxsize=16)
def compile_template(template: str) -> Any:
    """The compiled ``jinja2.Template`` (cached: a server renders one template many times)."""
    return _environment().from_string(template)


def parse_template(template: str) -> Any:
    """The template's syntax tree (a ``jinja2.nodes.Template``), parsed by the environment
    that renders it (its ``{% generation %}`` and loop-control tags known); nothing runs."""
    return _environment().parse(template)


@functools.lru_cache(maxsize=1)
def _environment() -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text for training
        masks; rendering keeps its body as is."""

        tags = frozenset({"generation"})

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """Jinja's ``namespace`` without underscore attributes (no way to CPython internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attributes = dict(*rest, **kwargs)
            for name in attributes:
                _check_attribute(name)
            jinja2.utils.Namespace.__init__(self, attributes)

        def __setitem__(self, name: str, value: Any) -> None:
            _check_attribute(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    def _check_attribute(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"but got {name!r}. Please rename the attribute."
            )

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationBlock, jinja2.ext.loopcontrols],
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    environment.globals["dict"] = _SafeDict()
    environment.globals["namespace"] = Namespace
    return environment


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters, which prompts must not contain.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _SafeDict:
    """``dict(...)`` and ``dict.fromkeys(...)`` for templates, without the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def plain(value: Any) -> Any:
    """``value`` rebuilt from JSON types only (templates run sandboxed, but the objects
    they see should carry no methods): dataclasses and pydantic models become dicts,
    anything unknown a ``"<TypeName>"`` placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain(key): plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain(item) for item in value)
    if hasattr(value, "item") and type(value).__module__ == "numpy":
        return plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _messages(conversation: Any) -> list[dict[str, Any]]:
    messages = []
    for message in plain(getattr(conversation, "messages", conversation)):
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        messages.append(message)
    return messages


def render_chat_template(
    template: str,
    conversation: Any,
    *,
    special_tokens: Mapping[str, Any],
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool | str = False,
    **kwargs: Any,
) -> str:
    """The prompt text of one conversation. ``special_tokens`` (``bos_token``, ...) are
    template variables that ``kwargs`` may override. Template errors (``jinja2``'s, and
    the template's own ``raise_exception``) propagate."""
    if continue_final_message and add_generation_prompt:
        raise ValueError(
            "continue_final_message and add_generation_prompt are not compatible: continue "
            "the final message, or prompt for a new assistant message."
        )
    for tool in tools or []:
        if not isinstance(tool, dict):
            raise ValueError("Tools must be JSON schemas (dicts) for this tokenizer.")
    messages = _messages(conversation)
    final_message = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final_message = _tag_final_message(template, messages, field)
    text = compile_template(template).render(
        messages=messages,
        tools=plain(tools),
        documents=plain(documents),
        add_generation_prompt=add_generation_prompt,
        **plain({**special_tokens, **kwargs}),
    )
    return text if final_message is None else _cut_after_final_message(text, final_message)


def _tag_final_message(template: str, messages: list[dict[str, Any]], field: str) -> str:
    """Appends ``_CONTINUE_TAG`` to the text of the last message; returns that text."""
    if not messages:
        raise ValueError("continue_final_message is set but the conversation is empty!")
    last = messages[-1]
    final = last.get(field)
    if final is None:
        raise ValueError(
            f'continue_final_message is set but the final message has no "{field}" to continue!'
        )
    fields = [field]
    if field in _REASONING_FIELDS:
        fields = [name for name in _REASONING_FIELDS if last.get(name) == final]
    if not any(name in template for name in fields):
        raise ValueError(
            f'continue_final_message is set to "{field}" but this is not an accepted field '
            "in the chat_template"
        )
    if isinstance(final, list | tuple):
        for block in reversed(final):
            if "text" in block:
                final, block["text"] = block["text"], block["text"] + _CONTINUE_TAG
                return final
        raise ValueError(
            "continue_final_message is set but we could not find any text to continue in the "
            "final message!"
        )
    for name in fields:
        last[name] = last[name] + _CONTINUE_TAG
    return final


def _cut_after_final_message(text: str, final_message: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_message.strip() not in text or tag not in text:
        raise ValueError(
            "continue_final_message is set but the final message does not appear in the chat "
            "after applying the chat template (the template deletes parts of it)."
        )
    position = text.rindex(tag)
    if text[position : position + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:position]
    return text[:position].rstrip()  # the template trimmed the message's trailing space
