"""Loads ``tests/cuda/triton_env.py`` (which must run before any Triton kernel is imported)
for test modules outside ``tests/cuda``, under the same module name those tests use."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_triton_env() -> ModuleType:
    if "triton_env" not in sys.modules:
        path = Path(__file__).resolve().parent / "cuda" / "triton_env.py"
        spec = importlib.util.spec_from_file_location("triton_env", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["triton_env"] = module
        spec.loader.exec_module(module)
    return sys.modules["triton_env"]
