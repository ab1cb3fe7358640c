"""Adding a plugin's parser to a registry of parsers by name (tool calls, reasoning)."""

from __future__ import annotations

from collections.abc import Iterable


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
