"""Finding custom logits processor classes: given classes, qualified names, entry points.

A name is ``package.module:Class`` or ``package.module.Class``. Names are what crosses a
process boundary (the engine-core process, worker processes), so a class given as an
object must be importable by its name there; ``portable_name`` checks that.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from importlib.metadata import entry_points
from typing import Any

from pagedlm.qualified_names import import_object, qualified_name
from pagedlm.sample.logits_processor.interface import LogitsProcessor

ENTRY_POINT_GROUP = "pagedlm.logits_processors"
"""Installed packages register processor classes here (vLLM: ``vllm.logits_processors``);
every one is loaded unless ``PAGEDLM_DISABLE_PLUGIN_AUTOLOAD`` is set."""
_AUTOLOAD_ENV = "PAGEDLM_DISABLE_PLUGIN_AUTOLOAD"


def _checked(candidate: Any, origin: str) -> type[LogitsProcessor]:
    if not (isinstance(candidate, type) and issubclass(candidate, LogitsProcessor)):
        raise ValueError(
            f"logits processor {origin} is {candidate!r}, not a subclass of "
            "pagedlm.sample.logits_processor.LogitsProcessor (or AdapterLogitsProcessor)."
        )
    return candidate


def resolve(spec: str | type) -> type[LogitsProcessor]:
    """The class a spec names (or the class itself), checked to be a ``LogitsProcessor``."""
    if isinstance(spec, str):
        return _checked(import_object(spec, "logits processor"), repr(spec))
    return _checked(spec, qualified_name(spec) if isinstance(spec, type) else repr(spec))


def portable_name(cls: type) -> str:
    """``cls``'s qualified name, which another process can import; a class defined in a
    function, or one another process cannot reach by its name, is refused."""
    name = qualified_name(cls)
    if "<locals>" in cls.__qualname__ or cls.__module__ == "__main__":
        raise ValueError(
            f"logits processor {name} cannot be sent to another process by name; define it "
            "at the top level of an importable module and pass 'module:Class'."
        )
    if import_object(name, "logits processor") is not cls:
        raise ValueError(f"logits processor {name} does not import back as the same class.")
    return name


def load_logits_processors(specs: Iterable[str | type]) -> tuple[type[LogitsProcessor], ...]:
    """The classes ``specs`` name, then the installed entry points' (each once)."""
    classes = [resolve(spec) for spec in specs]
    if os.environ.get(_AUTOLOAD_ENV, "").lower() not in ("1", "true", "yes"):
        for entry in entry_points(group=ENTRY_POINT_GROUP):
            classes.append(_checked(entry.load(), f"entry point {entry.name!r}"))
    return tuple(dict.fromkeys(classes))
