"""Adding a plugin's parser to a registry of parsers by name (tool calls, reasoning)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

P = TypeVar("P", bound=type)


def register(
    registry: dict[str, type], names: Iterable[str], cls: type, base: type, kind: str
) -> None:
    """Add ``cls`` (a ``base`` subclass) under each of ``names``; registering it again under
    the same name is a no-op, a name another class holds is an error."""
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise TypeError(f"a {kind} parser must subclass {base.__qualname__}; got {cls!r}.")
    for name in names:
        held = registry.get(name)
        if held is not None and held is not cls:
            raise ValueError(
                f"the {kind} parser name {name!r} is taken by {held.__qualname__}; register "
                f"{cls.__qualname__} under another name."
            )
    for name in names:
        registry[name] = cls


def registrar(registry: dict[str, type], base: type, kind: str) -> Callable[..., Callable[[P], P]]:
    """The class decorator factory ``register_<kind>_parser(*names)`` of ``registry``."""

    def register_names(*names: str) -> Callable[[P], P]:
        if not names:
            raise ValueError(f"register_{kind}_parser needs at least one name.")

        def register_class(cls: P) -> P:
            register(registry, names, cls, base, kind)
            return cls

        return register_class

    return register_names
