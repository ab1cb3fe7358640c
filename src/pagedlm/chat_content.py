"""How a chat message's ``content`` reaches the chat template (vLLM's
``chat_template_content_format``).

Templates read content one of two ways: most print ``message['content']`` and want a
string; some (Llama 4, Gemma 3, most vision models) loop over it and want OpenAI's list of
parts. The format is one of

- ``"string"``: the text parts joined with newlines into one string (``None`` is "");
- ``"openai"``: a list of ``{"type": "text", "text": ...}`` parts (a string becomes one
  part, ``None`` none); a tool message of text parts only still gets a string, as most
  templates print tool results as they are;
- ``"auto"``: ``"openai"`` if the template loops over some message's content, else
  ``"string"``, read from the template's syntax tree (nothing runs), as vLLM does: a
  ``{% for ... in X %}`` counts when X is ``messages`` or a name set from it (through
  filters, tests and slices) and Y is its loop variable's ``content``.

A part's kind is vLLM's reading of it (``part_type``): its ``"type"``, or for a part
without one the first key of ``TYPE_IMPLYING_KEYS`` it holds (``{"image_url": ...}`` is an
image part); a part with neither is an error that says to add ``"type"``. Text comes from
the text kinds of ``TEXT_PART_FIELDS`` (``"input_text"``, ``"refusal"``, ...) and from plain
string parts. As in vLLM, a ``"text"`` or ``"refusal"`` part whose text is null or missing
is skipped (``skipped_part``), and a ``"tool_reference"`` part (a deferred tool, by its
``"name"``) reaches the template as ``{"type": "tool_reference", "name": ...}``, or as its
name among the text in "string" (``tool_reference``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

logger = logging.getLogger(__name__)

ContentFormatOption = Literal["auto", "string", "openai"]
ContentFormat = Literal["string", "openai"]
CONTENT_FORMAT_OPTIONS: tuple[str, ...] = ("auto", "string", "openai")


TEXT_PART_FIELDS: dict[str, str] = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
"""The part types that carry text (vLLM's), and the field that holds it."""
TYPE_IMPLYING_KEYS: tuple[str, ...] = (
    "image_url",
    "image_pil",
    "image_embeds",
    "audio_embeds",
    "prompt_embeds",
    "audio_url",
    "input_audio",
    "video_url",
    "tool_reference",
)
"""vLLM's reading of a part without ``"type"``: the first of these keys it holds is its
type (``input_audio`` only when not null). Text keys imply nothing: ``{"text": ...}`` needs
its ``"type"``, as in vLLM."""
_NEEDS_TYPE_FIX = (
    'add its "type", e.g. {"type": "text", "text": ...} or {"type": "image_url", '
    '"image_url": {"url": ...}}'
)


SKIPPED_WHEN_NULL: tuple[str, ...] = ("text", "refusal")
"""vLLM skips a part of these types whose text is null or missing (it refuses the other
text kinds')."""
TOOL_REFERENCE = "tool_reference"


class ContentPartError(ValueError):
    """A content part that cannot be used; ``where`` is its place (``messages.0.content.1``)."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where}: {problem}")
        self.where = where


def implied_type(part: Mapping[str, Any]) -> str | None:
    """The part's type: its ``"type"`` (a string), else the one its keys imply (see
    ``TYPE_IMPLYING_KEYS``); None when it has neither."""
    kind = part.get("type")
    if kind is not None:
        return kind if isinstance(kind, str) else None
    for key in TYPE_IMPLYING_KEYS:
        if key in part and (key != "input_audio" or part[key] is not None):
            return key
    return None


def part_type(part: Mapping[str, Any], where: str) -> str:
    """``implied_type``, or a ``ContentPartError`` that says what to send."""
    kind = implied_type(part)
    if kind is not None:
        return kind
    got = part.get("type")
    if got is not None:
        raise ContentPartError(
            where,
            f'"type" must be a string such as "text" or "image_url", got '
            f"{type(got).__name__}; {_NEEDS_TYPE_FIX}.",
        )
    keys = ", ".join(repr(key)[:40] for key in list(part)[:8] if key != "type") or "none"
    raise ContentPartError(
        where,
        f'the part has no "type", and none of its keys ({keys}) implies one (a part '
        f'without "type" is read by its key: {", ".join(TYPE_IMPLYING_KEYS)}); '
        f"{_NEEDS_TYPE_FIX}.",
    )


def part_text(part: Any) -> str | None:
    """The text of a text part: a string, or a part of a ``TEXT_PART_FIELDS`` type whose
    text field is a string; None for every other part."""
    if isinstance(part, str):
        return part
    if not isinstance(part, Mapping):
        return None
    field = TEXT_PART_FIELDS.get(part.get("type"))  # type: ignore[arg-type]
    text = part.get(field) if field is not None else None
    return text if isinstance(text, str) else None


def skipped_part(part: Any, where: str) -> bool:
    """Whether the part is one vLLM skips (``SKIPPED_WHEN_NULL``), logged as vLLM does."""
    if not isinstance(part, Mapping) or part.get("type") not in SKIPPED_WHEN_NULL:
        return False
    field = TEXT_PART_FIELDS[part["type"]]
    if part.get(field) is not None:
        return False
    logger.warning('%s: skipped a "%s" part whose "%s" is null.', where, part["type"], field)
    return True


def tool_reference(part: Mapping[str, Any], where: str) -> dict[str, str]:
    """A ``"tool_reference"`` part as templates get it, ``{"type": "tool_reference",
    "name": ...}``; a ``ContentPartError`` when its ``"name"`` is not a string."""
    name = part.get("name")
    if not isinstance(name, str):
        got = "none" if name is None else type(name).__name__
        raise ContentPartError(
            where,
            f'a "tool_reference" part needs "name" to be a string (the tool it refers to), '
            f'got {got}; send {{"type": "tool_reference", "name": "get_weather"}}.',
        )
    return {"type": TOOL_REFERENCE, "name": name}


def check_continuable(messages: Sequence[Any], places: Sequence[str] | None = None) -> None:
    """``continue_final_message`` continues the last message from its last part holding
    ``"text"`` (transformers' reading; the rendered prompt is cut after it): a
    ``ContentPartError`` naming the fix for a last message whose content (template-ready:
    a string, or typed parts) has no such part (transformers' "could not find any text to
    continue" named none), or has an image part after it (the image would be lost).
    ``places``: each message's place in the request (default ``"messages.{i}"``)."""
    content = messages[-1].get("content") if messages and isinstance(messages[-1], dict) else None
    if not isinstance(content, list):
        return
    place = places[-1] if places else f"messages.{len(messages) - 1}"
    texts = [j for j, part in enumerate(content) if isinstance(part, Mapping) and "text" in part]
    last_text = texts[-1] if texts else -1
    after = next(
        (
            j
            for j in range(last_text + 1, len(content))
            if isinstance(content[j], Mapping) and content[j].get("type") == "image"
        ),
        None,
    )
    if after is not None:
        raise ContentPartError(
            f"{place}.content.{after}",
            "continue_final_message continues the last message from its last text part, "
            "and this image comes after it (the rendered prompt ends at that text); end the "
            "message with a text part, or drop continue_final_message.",
        )
    if not texts:
        raise ContentPartError(
            f"{place}.content",
            "continue_final_message continues the last message's text, and this message "
            "has none (no text part); end it with a text part such as "
            '{"type": "text", "text": "..."} (or send its content as a string), or drop '
            "continue_final_message.",
        )


def check_content_format(option: str) -> ContentFormatOption:
    if option not in CONTENT_FORMAT_OPTIONS:
        raise ValueError(
            f"chat_template_content_format={option!r} is not one of {list(CONTENT_FORMAT_OPTIONS)}."
        )
    return option  # type: ignore[return-value]


def resolve_content_format(option: ContentFormatOption, template: str | None) -> ContentFormat:
    """``option``, or for "auto" the format ``template`` reads ("string" without one)."""
    if option != "auto":
        return option
    return "string" if template is None else detect_content_format(template)


def template_source(tokenizer: Any, chat_template: str | None, tools: Any = None) -> str | None:
    """The template text ``apply_chat_template`` would use: ``chat_template`` (or, for a
    tokenizer with named templates, the one it names), else the tokenizer's ("tool_use"
    when there are tools and it has one); None when there is none."""
    try:
        source = tokenizer.get_chat_template(chat_template, tools=tools)
    except AttributeError:  # a tokenizer without named templates (GGUFTokenizer)
        source = chat_template if chat_template is not None else tokenizer.chat_template
    except ValueError:  # no template at all; rendering says so
        return None
    return source if isinstance(source, str) else None


@functools.lru_cache(maxsize=32)
def detect_content_format(template: str) -> ContentFormat:
    """The format ``template`` reads: "openai" when it loops over a message's content, else
    "string" (also when it does not parse: rendering then reports the template's error)."""
    from pagedlm.chat_templates import parse_template

    try:
        tree = parse_template(template)
        found = next(_content_loops(tree), None) is not None
    except Exception as error:  # a syntax error, or a tree too deep to walk
        logger.debug("chat template not parsed for its content format: %s", error)
        return "string"
    return "openai" if found else "string"


def _content_loops(tree: Any) -> Iterator[Any]:
    """The ``For`` nodes whose iterable is a message's content."""
    import jinja2.nodes as nodes

    message_names = {loop.target.name for loop in _loops_over(tree, _names_of(tree, "messages"))}
    for loop in tree.find_all(nodes.For):
        if any(_reads(loop.iter, name, "content") for name in message_names):
            yield loop


def _names_of(tree: Any, root: str) -> set[str]:
    """``root`` and every name set (``{% set x = ... %}``) from one of these names."""
    import jinja2.nodes as nodes

    names, pending = {root}, [root]
    while pending:
        name = pending.pop()
        for assign in tree.find_all(nodes.Assign):
            target = assign.target
            new = isinstance(target, nodes.Name) and target.name not in names
            if new and _reads(assign.node, name):
                names.add(target.name)
                pending.append(target.name)
    return names


def _loops_over(tree: Any, names: set[str]) -> Iterator[Any]:
    """``For`` nodes over one of ``names`` with a single loop variable."""
    import jinja2.nodes as nodes

    for loop in tree.find_all(nodes.For):
        if isinstance(loop.target, nodes.Name) and any(_reads(loop.iter, n) for n in names):
            yield loop


def _reads(node: Any, name: str, key: str | None = None) -> bool:
    """``node`` is ``name`` (or ``name[key]`` / ``name.key``), maybe filtered, tested or
    sliced."""
    import jinja2.nodes as nodes

    while (isinstance(node, nodes.Filter | nodes.Test) and node.node is not None) or (
        isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)
    ):
        node = node.node
    if key is None:
        return _is_name(node, name)
    if isinstance(node, nodes.Getitem):
        return (
            _is_name(node.node, name)
            and isinstance(node.arg, nodes.Const)
            and node.arg.value == key
        )
    return isinstance(node, nodes.Getattr) and _is_name(node.node, name) and node.attr == key


def _is_name(node: Any, name: str) -> bool:
    import jinja2.nodes as nodes

    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def format_conversation(
    conversation: Sequence[dict[str, Any]], content_format: ContentFormat
) -> list[dict[str, Any]]:
    """The messages (copies) with ``content`` in ``content_format``. Content is a string,
    None, or a list of parts: text parts (``part_text``), rebuilt as ``{"type": "text",
    "text": ...}``, tool references (``tool_reference``; their names in "string"), and,
    kept as they are in "openai", other parts (a ``ValueError`` in "string"). Null
    ``"text"``/``"refusal"`` parts are left out (``skipped_part``)."""
    formatted = []
    for i, message in enumerate(conversation):
        if not isinstance(message, dict):  # the renderer refuses it, naming it
            formatted.append(message)
            continue
        content = message.get("content")
        where = f"messages.{i}.content"
        if content_format == "string":
            content = "\n".join(_texts(content, where))
        else:
            content = _parts(content, where)
            if message.get("role") == "tool" and all(_is_text_part(p) for p in content):
                content = "\n".join(part["text"] for part in content)
        formatted.append({**message, "content": content})
    return formatted


def _texts(content: Any, where: str) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    texts = []
    for j, part in enumerate(content):
        if skipped_part(part, f"{where}.{j}"):
            continue
        text = part_text(part)
        if text is None:
            _check_part(part, f"{where}.{j}")
            kind = implied_type(part)
            if kind == TOOL_REFERENCE:  # vLLM joins the tool's name in
                texts.append(tool_reference(part, f"{where}.{j}")["name"])
                continue
            raise ValueError(
                f"{where}.{j}: a part of type {kind!r} cannot be joined into the string "
                'content this chat template reads; send {"type": "text", "text": ...} '
                "parts, or use chat_template_content_format='openai'."
            )
        texts.append(text)
    return texts


def _parts(content: Any, where: str) -> list[Any]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    parts = []
    for j, part in enumerate(content):
        if skipped_part(part, f"{where}.{j}"):
            continue
        text = part_text(part)
        if text is not None:
            parts.append({"type": "text", "text": text})
            continue
        _check_part(part, f"{where}.{j}")
        is_reference = implied_type(part) == TOOL_REFERENCE
        parts.append(tool_reference(part, f"{where}.{j}") if is_reference else part)
    return parts


def _check_part(part: Any, where: str) -> None:
    """A part kept for the template: an object with a type (vLLM's reading); a
    ``ContentPartError`` that says what to send for anything else."""
    if not isinstance(part, Mapping):
        raise ContentPartError(
            where,
            f"a content part is a string or a dict such as {{'type': 'text', 'text': ...}}, "
            f"got {type(part).__name__}.",
        )
    part_type(part, where)


def _is_text_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text"
