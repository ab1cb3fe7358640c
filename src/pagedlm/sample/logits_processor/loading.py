"""Finding custom logits processor classes: given classes, qualified names, entry points.

A name is ``package.module:Class`` or ``package.module.Class``. Names are what crosses a
process boundary (the engine-core process, worker processes), so a class given as an
object must be importable by its name there; ``portable_name`` checks that.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterable
from importlib.metadata import entry_points
from typing import Any

from pagedlm.sample.logits_processor.interface import LogitsProcessor

ENTRY_POINT_GROUP = "pagedlm.logits_processors"
"""Installed packages register processor classes here (vLLM: ``vllm.logits_processors``);
every one is loaded unless ``PAGEDLM_DISABLE_PLUGIN_AUTOLOAD`` is set."""
_AUTOLOAD_ENV = "PAGEDLM_DISABLE_PLUGIN_AUTOLOAD"


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _import(name: str) -> Any:
    module_name, sep, attribute = name.partition(":")
    if not sep:
        module_name, _, attribute = name.rpartition(".")
    if not module_name or not attribute:
        raise ValueError(
            f"logits processor {name!r} is not a qualified class name; write "
            "'package.module:Class' (or 'package.module.Class')."
        )
    try:
        module = sys.modules.get(module_name) or importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"logits processor {name!r}: cannot import {module_name!r} ({error}); make the "
            "module importable (install it, or add its directory to PYTHONPATH)."
        ) from None
    target: Any = module
    for part in attribute.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ValueError(
                f"logits processor {name!r}: {module_name!r} has no attribute {attribute!r}."
            )
    return target


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
        return _checked(_import(spec), repr(spec))
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
    if _import(name) is not cls:
        raise ValueError(f"logits processor {name} does not import back as the same class.")
    return name


def load_logits_processors(specs: Iterable[str | type]) -> tuple[type[LogitsProcessor], ...]:
    """The classes ``specs`` name, then the installed entry points' (each once)."""
    classes = [resolve(spec) for spec in specs]
    if os.environ.get(_AUTOLOAD_ENV, "").lower() not in ("1", "true", "yes"):
        for entry in entry_points(group=ENTRY_POINT_GROUP):
            classes.append(_checked(entry.load(), f"entry point {entry.name!r}"))
    return tuple(dict.fromkeys(classes))
