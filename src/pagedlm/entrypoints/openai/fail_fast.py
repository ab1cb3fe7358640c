"""Request models whose lists and dicts stop validating at their first bad item.

pydantic checks every item of a list and keeps one error per bad item, per member of a
union: ``prompt: [7, 7, ..., "x"]`` against ``str | list[str] | list[int] | ...`` is one
error per id for ``list[str]`` alone, and listing a million errors (``errors()``) holds
the interpreter for many seconds, however the body is parsed. A valid token-id prompt
pays for the ``list[str]`` member's errors too. With ``fail_fast`` every list, tuple, set
and dict of a model stops at its first bad item, so a body's errors are bounded by its
model, not by its size; the 400 then names each collection's first bad item (the most
specific of those, ``request_body.validation_message``).

``FailFastModel`` applies this to a model's own core schema, nested collections included;
a nested model is validated by its own class, so every request model and every model it
nests derives from it (``tests/server/test_request_body_cost.py`` checks the app's).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, GetCoreSchemaHandler
from pydantic_core import CoreSchema

COLLECTION_SCHEMAS = frozenset({"list", "tuple", "set", "frozenset", "dict"})
"""The core-schema types that take ``fail_fast``."""

_VALUE_KEYS = frozenset({"default", "metadata", "serialization"})
"""Core-schema keys whose values are data or serializers, never validation schemas."""
_NAMED_SCHEMAS = frozenset({"fields", "choices"})
"""Core-schema keys whose values may map names (fields, union tags) to schemas."""


def with_fail_fast(schema: Any) -> Any:
    """A copy of core schema ``schema`` in which every collection has ``fail_fast``."""
    if isinstance(schema, list | tuple):
        return type(schema)(with_fail_fast(item) for item in schema)
    if not isinstance(schema, dict):
        return schema
    copied = {}
    for key, value in schema.items():
        if key in _VALUE_KEYS:
            copied[key] = value
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):
            copied[key] = {name: with_fail_fast(item) for name, item in value.items()}
        else:
            copied[key] = with_fail_fast(value)
    kind = copied.get("type")
    if isinstance(kind, str) and kind in COLLECTION_SCHEMAS:
        copied["fail_fast"] = True
    return copied


class FailFastModel(BaseModel):
    """A model whose collections stop at their first bad item (see the module docstring)."""

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: type[BaseModel], handler: GetCoreSchemaHandler, /
    ) -> CoreSchema:
        return with_fail_fast(handler(source))
