"""Objects named by import path, as flags and configs give them ('package.module:Name' or
'package.module.Name'): custom logits processors, server middleware."""

from __future__ import annotations

import importlib
import sys
from typing import Any


def qualified_name(obj: Any) -> str:
    """``module:qualname`` of a class or function, which ``import_object`` reverses."""
    return f"{obj.__module__}:{obj.__qualname__}"


def import_object(name: str, what: str) -> Any:
    """The object ``name`` points at; ValueError naming ``what`` it was for and the fix."""
    module_name, sep, attribute = name.partition(":")
    if not sep:
        module_name, _, attribute = name.rpartition(".")
    if not module_name or not attribute:
        raise ValueError(
            f"{what} {name!r} is not a qualified name; write 'package.module:Name' (or "
            "'package.module.Name')."
        )
    try:
        module = sys.modules.get(module_name) or importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"{what} {name!r}: cannot import {module_name!r} ({error}); make the module "
            "importable (install it, or add its directory to PYTHONPATH)."
        ) from None
    target: Any = module
    for part in attribute.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ValueError(f"{what} {name!r}: {module_name!r} has no attribute {attribute!r}.")
    return target
