"""A request's ``cache_salt`` at the API edge: vLLM's field on the generation and pooling
routes. Requests with different salts never share prefix-cache blocks (the salt enters
the digest of a prompt's first block), so one tenant cannot learn from cache hits what
another sent; a salt should be random and secret. Prefix caching off, it is accepted and
changes nothing, as in vLLM.

vLLM's rule, checked before the engine sees it: a non-empty string of at most
``CACHE_SALT_MAX_CHARS`` characters, none of them ``@``, ``/``, ``\\`` or NUL (KV
connectors write salts into keys and file names).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, Field
from pydantic_core import PydanticCustomError

CACHE_SALT_MAX_CHARS = 128
FORBIDDEN_CHARS = frozenset("@/\\\x00")


def _check(salt: str | None) -> str | None:
    if salt is None:
        return None
    if not salt or len(salt) > CACHE_SALT_MAX_CHARS or not FORBIDDEN_CHARS.isdisjoint(salt):
        raise PydanticCustomError(
            "cache_salt",
            "a salt is 1 to {limit} characters, none of them '@', '/', '\\' or NUL (this one "
            "has {length}); send a random secret, e.g. 32 random bytes as URL-safe base64.",
            {"limit": CACHE_SALT_MAX_CHARS, "length": len(salt)},
        )
    return salt


CacheSalt = Annotated[
    str | None,
    AfterValidator(_check),
    Field(
        description="Requests with different salts never share prefix-cache blocks: a random "
        f"secret of 1 to {CACHE_SALT_MAX_CHARS} characters, without '@', '/', '\\' or NUL.",
    ),
]
"""The ``cache_salt`` field of a request body (None: unsalted)."""


def salted(prompt: Any, cache_salt: str | None) -> Any:
    """An engine prompt carrying ``cache_salt``: a text as ``{"prompt": ...}``, a prompt dict
    with the key added, a cross-encoder's ``(text_1, text_2)`` pair as
    ``{"text_1", "text_2"}`` (``pagedlm.pooling.requests.TextPairPrompt``)."""
    if cache_salt is None:
        return prompt
    if isinstance(prompt, str):
        return {"prompt": prompt, "cache_salt": cache_salt}
    if isinstance(prompt, tuple):
        text_1, text_2 = prompt
        return {"text_1": text_1, "text_2": text_2, "cache_salt": cache_salt}
    return {**prompt, "cache_salt": cache_salt}
