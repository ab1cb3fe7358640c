"""vLLM's arguments checked at the edge: each ``VllmCompatArgs`` value against what
``VLLM_ONLY`` says of it (an unsupported value refused, an ignored or deprecated one
logged), and vLLM's deprecated spellings taken as the arguments that replaced them
(``--guided-decoding-backend`` as ``structured_outputs_config``'s backend, ``--task`` as
``--runner``, ``--rope-scaling`` as ``hf_overrides``, ...)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from pagedlm.engine.vllm_compat_args import DEPRECATED, IGNORED, VLLM_ONLY, is_silent

EngineArgs = Any
"""An ``arg_utils.EngineArgs`` (which imports this module)."""

logger = logging.getLogger(__name__)

TASK_RUNNERS = {
    "generate": "generate",
    "transcription": "generate",
    "embed": "pooling",
    "embedding": "pooling",
    "classify": "pooling",
    "score": "pooling",
    "reward": "pooling",
}
"""vLLM's deprecated ``task`` names -> the runner that serves them."""
GUIDED_KEYS = {
    "guided_decoding_backend": "backend",
    "guided_decoding_disable_fallback": "disable_fallback",
    "guided_decoding_disable_any_whitespace": "disable_any_whitespace",
    "guided_decoding_disable_additional_properties": "disable_additional_properties",
}
"""vLLM's deprecated guided-decoding arguments -> their ``structured_outputs_config`` keys."""
VLLM_LOAD_FORMATS = {
    "npcache": "pagedlm reads PyTorch .bin files directly, without a numpy cache; use "
    "--load-format pt",
    "fastsafetensors": "use --load-format safetensors (pagedlm memory-maps them)",
    "runai_streamer": "use --load-format safetensors from a local directory or hub id",
    "runai_streamer_sharded": "use --load-format safetensors from a local directory or hub id",
    "sharded_state": "load the checkpoint it was saved from, with --load-format auto",
    "tensorizer": "load the Hugging Face checkpoint with --load-format auto",
    "mistral": "load the checkpoint's Hugging Face files (config.json, *.safetensors)",
}
"""vLLM's weight loaders that pagedlm does not have, and what to use instead."""
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def resolve_vllm_args(args: EngineArgs, warn: bool = True) -> EngineArgs:
    """``args`` with vLLM's deprecated arguments moved to the ones that replaced them;
    ValueError naming the fix for an unsupported value or a contradiction. ``warn``: log
    the arguments that have no effect here and vLLM's deprecation warnings."""
    check_vllm_args(args, warn)
    changes: dict[str, Any] = {}
    for resolve in (_task, _rope, _pooler, _guided_decoding, _graph_sizes, _load_format):
        changes.update(resolve(args))
    return dataclasses.replace(args, **changes) if changes else args


def check_vllm_args(args: EngineArgs, warn: bool = True) -> None:
    """Refuse the unsupported values of vLLM's arguments; log (``warn``) the others that
    are not vLLM's defaults."""
    _check_swap_space(args.swap_space)
    for name, spec in VLLM_ONLY.items():
        value = getattr(args, name)
        if is_silent(name, value) or _means_the_default(args, name, value):
            continue
        if spec.kind == IGNORED:
            if warn:
                logger.warning(
                    "%s=%r (%s) has no effect in pagedlm: %s.", name, value, flag(name), spec.why
                )
        elif spec.kind == DEPRECATED:
            if warn:
                logger.warning("%s.", spec.why)
        else:
            raise ValueError(
                f"{name}={value!r} ({flag(name)}) is vLLM's, and pagedlm does not support it: "
                f"{spec.why}; {spec.fix}."
            )


def _means_the_default(args: EngineArgs, name: str, value: Any) -> bool:
    """Values that mean the default only next to another argument."""
    if name == "data_parallel_size_local":  # every replica on this node
        return value == args.data_parallel_size
    if name == "lora_dtype":  # read with LoRA only, and the model's dtype is the adapters'
        return not args.enable_lora or _same_dtype(value, args.dtype)
    return False


def _same_dtype(a: str, b: str) -> bool:
    from pagedlm.config import parse_dtype

    if "auto" in (a, b):
        return False
    try:
        return parse_dtype(a) == parse_dtype(b)
    except ValueError:
        return False


def _check_swap_space(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"swap_space must be a number of GiB >= 0, got {value!r} (--swap-space).")


def _task(args: EngineArgs) -> dict[str, Any]:
    task = args.task
    if task in (None, "auto"):
        return {"task": None}
    runner = TASK_RUNNERS.get(task)
    if runner is None:
        raise ValueError(
            f"task={task!r} (--task) is unknown; vLLM's tasks are {sorted(TASK_RUNNERS)}, "
            "and --runner (generate or pooling) replaces them."
        )
    if args.runner not in ("auto", runner):
        raise ValueError(
            f"task={task!r} (--task) means runner={runner!r}, but runner={args.runner!r}; "
            "drop --task (vLLM deprecated it for --runner)."
        )
    return {"task": None, "runner": runner}


def _rope(args: EngineArgs) -> dict[str, Any]:
    given = {
        key: value
        for key, value in (("rope_scaling", args.rope_scaling), ("rope_theta", args.rope_theta))
        if value is not None
    }
    if not given:
        return {}
    overrides = dict(args.hf_overrides or {})
    for key, value in given.items():
        if key in overrides and overrides[key] != value:
            raise ValueError(
                f"{key} is given twice, as {flag(key)} {value!r} and in hf_overrides as "
                f"{overrides[key]!r}; pass it once, in --hf-overrides."
            )
        overrides[key] = value
    return {"hf_overrides": overrides, **dict.fromkeys(given)}


def _pooler(args: EngineArgs) -> dict[str, Any]:
    value = args.override_pooler_config
    if value is None:
        return {}
    if args.pooler_config not in (None, value):
        raise ValueError(
            "pooler_config and override_pooler_config (vLLM's deprecated name for it) are "
            "both given and differ; pass --pooler-config alone."
        )
    return {"pooler_config": value, "override_pooler_config": None}


def _guided_decoding(args: EngineArgs) -> dict[str, Any]:
    given = {name: getattr(args, name) for name in GUIDED_KEYS if getattr(args, name) is not None}
    if not given:
        return {}
    config = dict(args.structured_outputs_config or {})
    for name, value in given.items():
        key = GUIDED_KEYS[name]
        value = value if key == "backend" else _bool(name, value)
        if key in config and config[key] != value:
            raise ValueError(
                f"structured_outputs_config.{key} is given twice: {config[key]!r} there and "
                f"{value!r} as {flag(name)} (vLLM's deprecated spelling); pass it once, in "
                "--structured-outputs-config."
            )
        config[key] = value
    return {"structured_outputs_config": config, **dict.fromkeys(given)}


def _bool(name: str, value: bool | str) -> bool:
    """vLLM's guided-decoding switches took a value (``--flag true``) or none (True)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ValueError(f"{name} ({flag(name)}) takes true or false, got {value!r}.")


def _graph_sizes(args: EngineArgs) -> dict[str, Any]:
    if args.cuda_graph_sizes is None:
        return {}
    if args.cudagraph_capture_sizes is not None:
        raise ValueError(
            "cuda_graph_sizes and cudagraph_capture_sizes are one setting (vLLM's deprecated "
            "name and its current one); pass --cudagraph-capture-sizes alone."
        )
    return {"cudagraph_capture_sizes": args.cuda_graph_sizes, "cuda_graph_sizes": None}


def _load_format(args: EngineArgs) -> dict[str, Any]:
    """vLLM's ``load_format='bitsandbytes'`` is its loader for ``quantization='bitsandbytes'``,
    which pagedlm's ``auto`` loader is; its other loaders are refused naming the fix."""
    name = args.load_format
    if name in VLLM_LOAD_FORMATS:
        raise ValueError(
            f"load_format={name!r} (vLLM's loader) is not available in pagedlm: "
            f"{VLLM_LOAD_FORMATS[name]}."
        )
    if name != "bitsandbytes":
        return {}
    if args.quantization != "bitsandbytes":
        raise ValueError(
            "load_format='bitsandbytes' loads a model quantized by bitsandbytes, but "
            f"quantization={args.quantization!r}; add --quantization bitsandbytes (or drop "
            "--load-format)."
        )
    return {"load_format": "auto"}
