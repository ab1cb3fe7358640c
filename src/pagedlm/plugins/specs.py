"""Small frozen specs that plugins return from their hooks.

A spec names its implementation as ``"module:Class"``; the module is imported only when
the component is selected, so registering costs nothing.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def import_target(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    if not attr:
        raise ValueError(f"Plugin target {target!r} must look like 'package.module:Name'.")
    return getattr(importlib.import_module(module_name), attr)


def _always() -> bool:
    return True


@dataclass(frozen=True)
class PlatformSpec:
    """A platform a plugin offers.

    ``is_available`` is a cheap probe (import nothing heavy, touch no device memory); it
    returns True/False, or raises to report why the platform cannot work here.
    """

    name: str
    target: str
    is_available: Callable[[], bool] = _always
    priority: int = 0
    description: str = ""


@dataclass(frozen=True)
class BackendSpec:
    """An attention backend for one platform (``platform`` is that platform's name)."""

    name: str
    target: str
    platform: str
    priority: int = 0


@dataclass(frozen=True)
class ExecutorSpec:
    """An executor; ``platforms`` empty means it works on any platform."""

    name: str
    target: str
    platforms: tuple[str, ...] = ()
    priority: int = 0
