"""vLLM's ``compilation_config`` (``-cc``/``--compilation-config``) and
``optimization_level`` (``-O0`` .. ``-O3``) as ``pagedlm.config.CompilationConfig``.

pagedlm compiles nothing with ``torch.compile`` (its kernels are Triton's), so of vLLM's
compilation options only the CUDA-graph ones act: ``cudagraph_mode``,
``cudagraph_capture_sizes`` and ``max_cudagraph_capture_size``. The optimization level
gives the graph mode a default, as in vLLM: 0 none, 1 piecewise, 2 and 3 full and
piecewise; a ``cudagraph_mode`` given in the config wins, and ``enforce_eager`` turns
graphs off whatever either says. vLLM's compile mode (``mode``, formerly ``level``) is
accepted and logged as having no effect; its compiler options (``pass_config``,
``custom_ops``, ``splitting_ops``, ...) are refused, naming the fix.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from pagedlm.config import CompilationConfig

logger = logging.getLogger(__name__)

CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
LEVEL_CUDAGRAPH_MODES = {
    0: "NONE",
    1: "PIECEWISE",
    2: "FULL_AND_PIECEWISE",
    3: "FULL_AND_PIECEWISE",
}
"""vLLM's optimization levels' graph modes (levels 2 and 3 are the same there too)."""
DEFAULT_OPTIMIZATION_LEVEL = 2
COMPILE_MODES = ("NONE", "STOCK_TORCH_COMPILE", "DYNAMO_TRACE_ONCE", "VLLM_COMPILE")
"""vLLM's ``CompilationMode`` names (or their numbers 0-3): accepted, no effect here."""
GRAPH_KEYS = frozenset({"cudagraph_mode", "cudagraph_capture_sizes", "max_cudagraph_capture_size"})


def resolve_compilation(
    value: dict[str, Any] | str | int | CompilationConfig | None,
    optimization_level: int = DEFAULT_OPTIMIZATION_LEVEL,
    enforce_eager: bool = False,
    *,
    capture_sizes: list[int] | None = None,
    max_capture_size: int | None = None,
) -> CompilationConfig:
    """The graph settings of ``compilation_config`` (None, a dict, its JSON, a compile
    mode number as vLLM's older ``LLM(compilation_config=3)``, or a config) at
    ``optimization_level``, with vLLM's ``--cudagraph-capture-sizes`` and
    ``--max-cudagraph-capture-size`` (``capture_sizes``, ``max_capture_size``) in it;
    ValueError naming the fix for what pagedlm cannot honour."""
    if (
        isinstance(optimization_level, bool)
        or not isinstance(optimization_level, int)
        or optimization_level not in LEVEL_CUDAGRAPH_MODES
    ):
        raise ValueError(
            f"optimization_level must be 0, 1, 2 or 3 (-O0 .. -O3), got {optimization_level!r}."
        )
    flags = {
        "cudagraph_capture_sizes": capture_sizes,
        "max_cudagraph_capture_size": max_capture_size,
    }
    flags = {key: given for key, given in flags.items() if given is not None}
    if isinstance(value, CompilationConfig) and flags:
        value = dataclasses.asdict(value)
    if isinstance(value, CompilationConfig):
        config = value
    else:
        values = _with_flags(_as_dict(value), flags)
        _check_keys(values)
        if "mode" in values or "level" in values:
            _check_compile_mode(values.get("mode", values.get("level")))
        mode = values.get("cudagraph_mode")
        config = CompilationConfig(
            cudagraph_mode=(
                LEVEL_CUDAGRAPH_MODES[optimization_level] if mode is None else _graph_mode(mode)
            ),
            cudagraph_capture_sizes=_sizes(values.get("cudagraph_capture_sizes")),
            max_cudagraph_capture_size=_positive(
                "max_cudagraph_capture_size", values.get("max_cudagraph_capture_size")
            ),
        )
    if enforce_eager and config.cudagraph_mode != "NONE":
        return CompilationConfig("NONE", config.cudagraph_capture_sizes)
    if config.cudagraph_mode == "FULL":
        logger.info(
            "cudagraph_mode=FULL: uniform steps (decodes, verifications) replay whole "
            "graphs; a mixed step's attention cannot be captured whole, so mixed steps run "
            "eagerly (FULL_AND_PIECEWISE replays their other layers)."
        )
    return config


def _with_flags(values: dict[str, Any], flags: dict[str, Any]) -> dict[str, Any]:
    """``values`` with the graph fields given as flags of their own; a field given in both
    places is an error, as in vLLM (they are one setting)."""
    for key in flags:
        if values.get(key) is not None:
            raise ValueError(
                f"{key} is given twice, as --{key.replace('_', '-')} and in "
                "compilation_config; give it in one place."
            )
    return {**values, **flags}


def _as_dict(value: dict[str, Any] | str | int | None) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, int) and not isinstance(value, bool):
        return {"mode": value}  # vLLM's older integer form: the compile level
    if isinstance(value, str):
        text = value.strip()
        if text.isdigit():
            return {"mode": int(text)}
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"compilation_config is not valid JSON ({error.msg}): {text!r}."
            ) from None
    if not isinstance(value, dict):
        raise ValueError(
            "compilation_config must be a JSON object, e.g. "
            '\'{"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4, 8]}\'.'
        )
    return value


def _check_keys(values: dict[str, Any]) -> None:
    unknown = sorted(set(values) - GRAPH_KEYS - {"mode", "level"})
    if unknown:
        raise ValueError(
            f"compilation_config key(s) {unknown} are not supported: pagedlm compiles "
            "nothing with torch.compile (its kernels are Triton's), so only "
            f"{sorted(GRAPH_KEYS)} (and the compile mode, which has no effect) apply; "
            "drop the others."
        )


def _check_compile_mode(mode: Any) -> None:
    names = {str(i): name for i, name in enumerate(COMPILE_MODES)}
    name = names.get(str(mode), str(mode).upper())
    if name not in COMPILE_MODES:
        raise ValueError(
            f"compilation_config mode={mode!r} is unknown; vLLM's modes are "
            f"{', '.join(COMPILE_MODES)} (or 0-3)."
        )
    logger.info(
        "compilation_config mode=%s has no effect: pagedlm does not torch.compile its models "
        "(its kernels are Triton's); the CUDA-graph fields apply.",
        name,
    )


def _graph_mode(mode: Any) -> str:
    name = str(mode).upper()
    if name not in CUDAGRAPH_MODES:
        raise ValueError(
            f"cudagraph_mode={mode!r} is unknown; use one of {', '.join(CUDAGRAPH_MODES)}."
        )
    return name


def _positive(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"compilation_config {name} must be a positive integer, got {value!r}.")
    return value


def _sizes(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple):
        raise ValueError(
            f"cudagraph_capture_sizes must be a list of positive integers, got {value!r}."
        )
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in value):
        raise ValueError(f"cudagraph_capture_sizes must be positive integers, got {list(value)!r}.")
    return tuple(sorted(set(value)))
