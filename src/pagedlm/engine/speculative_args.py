"""``speculative_config`` (a dict, or its JSON on the command line) -> ``SpeculativeConfig``.

The keys are vLLM's: ``method`` ("ngram", "draft_model", "eagle", "eagle3", "mtp", which
vLLM also spells "deepseek_mtp"), ``num_speculative_tokens``, ``model`` (the draft or the
EAGLE head: a directory, .gguf file or hub id; "mtp" reads the target's own checkpoint), ``prompt_lookup_min``/``prompt_lookup_max`` (ngram, both 5 when neither is
given, as in vLLM), ``disable_by_batch_size``, ``revision`` (of a hub ``model``), plus
pagedlm's ``min_acceptance_rate`` (the never-hurts policy) and, for benchmarks only,
method "acceptance" with ``acceptance_rate`` and ``reference_path``. Every error names the
key to change and how.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pagedlm.config import SPECULATIVE_METHODS, ArchConfig, ModelConfig, SpeculativeConfig

logger = logging.getLogger(__name__)

_KEYS = {
    "method",
    "num_speculative_tokens",
    "model",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "disable_by_batch_size",
    "min_acceptance_rate",
    "revision",
    "acceptance_rate",
    "reference_path",
}
_MODEL_METHODS = ("draft_model", "eagle", "eagle3")
_METHOD_ALIASES = {"deepseek_mtp": "mtp"}
"""vLLM's older per-model names for "mtp"."""
_MAX_NUM_SPECULATIVE_TOKENS = 31
"""A verification step feeds 1 + k tokens per request; graphs capture up to 32."""

Resolve = Callable[[str, str, str | None], str]
"""``(what, name, revision) -> local path`` (a directory or .gguf file; downloads hub ids)."""


def _error(message: str) -> ValueError:
    return ValueError(f"speculative_config: {message}")


def _as_dict(value: dict[str, Any] | str) -> dict[str, Any]:
    if isinstance(value, dict):
        return dict(value)
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise _error(
            f"{value!r} is not JSON ({exc.msg}); pass e.g. "
            '\'{"method": "ngram", "num_speculative_tokens": 4}\'.'
        ) from None
    if not isinstance(parsed, dict):
        raise _error(f"expected a JSON object, got {type(parsed).__name__}.")
    return parsed


def _int(values: dict[str, Any], key: str, minimum: int) -> int | None:
    value = values.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _error(f"{key} must be an integer >= {minimum}, got {value!r}.")
    return value


def _method(values: dict[str, Any]) -> str:
    method = values.get("method")
    model = values.get("model")
    if method is None:
        if model is None:
            raise _error(
                'no "method"; set "method" to one of ngram, draft_model, eagle, eagle3 '
                '(a draft or EAGLE head also needs "model").'
            )
        # vLLM's inference from the model name.
        lowered = str(model).lower()
        method = "eagle3" if "eagle3" in lowered else "eagle" if "eagle" in lowered else None
        method = method or "draft_model"
    if isinstance(method, str):
        method = _METHOD_ALIASES.get(method, method)
    if method not in SPECULATIVE_METHODS:
        raise _error(
            f"method={method!r} is unknown; use one of ngram, draft_model, eagle, eagle3, mtp."
        )
    return str(method)


def parse_speculative_config(
    value: dict[str, Any] | str | None,
    target: ModelConfig,
    max_num_batched_tokens: int,
    resolve: Resolve,
) -> SpeculativeConfig | None:
    """The validated configuration, or None when ``value`` is None or empty."""
    if value is None or value == "" or value == {}:
        return None
    values = _as_dict(value)
    unknown = sorted(set(values) - _KEYS)
    if unknown:
        raise _error(f"unknown key(s) {unknown}; supported keys: {sorted(_KEYS)}.")
    method = _method(values)
    num_tokens = _int(values, "num_speculative_tokens", 1)
    if num_tokens is None:
        if "num_speculative_tokens" in values:
            raise _error("num_speculative_tokens must be an integer >= 1, got None.")
        raise _error('set "num_speculative_tokens" (the drafts verified per step), e.g. 4.')
    if num_tokens > _MAX_NUM_SPECULATIVE_TOKENS:
        raise _error(
            f"num_speculative_tokens={num_tokens} is more than {_MAX_NUM_SPECULATIVE_TOKENS}; "
            "lower it (acceptance rarely reaches that far)."
        )
    if num_tokens + 1 > max_num_batched_tokens:
        raise _error(
            f"num_speculative_tokens={num_tokens} needs {num_tokens + 1} tokens per step, more "
            f"than max_num_batched_tokens={max_num_batched_tokens}; lower it or raise "
            "--max-num-batched-tokens."
        )
    config = SpeculativeConfig(method=method, num_speculative_tokens=num_tokens)
    config = _with_policy(config, values)
    if method == "ngram":
        return _with_ngram(config, values)
    for key in ("prompt_lookup_min", "prompt_lookup_max"):
        if key in values:
            raise _error(f"{key} applies to method 'ngram' only; remove it for {method!r}.")
    if method == "acceptance":
        return _with_acceptance(config, values)
    if method == "mtp":  # the workers read the layer from the target's own checkpoint
        _check_mtp_target(values, target, resolve)
        return config
    return replace(config, draft_model=_draft_model(method, values, target, resolve))


def _check_mtp_target(values: dict[str, Any], target: ModelConfig, resolve: Resolve) -> None:
    """Start-up errors for a target whose checkpoint has no multi-token-prediction layer
    to draft with, or a ``model`` that is not the target."""
    from pagedlm.model_executor.models.deepseek_moe import V2_ARCHITECTURE
    from pagedlm.model_executor.models.deepseek_mtp import mtp_layer_count

    arch = target.arch
    families = (V2_ARCHITECTURE, "DeepseekV3ForCausalLM")
    if arch.architecture not in families:
        raise _error(
            f"method 'mtp' drafts with a DeepSeek checkpoint's multi-token-prediction layer; "
            f"the target is {arch.architecture}. Use ngram, draft_model or an EAGLE head."
        )
    if mtp_layer_count(arch) < 1:
        raise _error(
            f"the target {target.model} has no multi-token-prediction layer "
            "(num_nextn_predict_layers is 0 or missing in its config.json); use ngram, "
            "draft_model or an EAGLE head."
        )
    if mtp_layer_count(arch) > 1:
        logger.warning(
            "%s has %d multi-token-prediction layers; the MTP proposer drafts every token with "
            "the first (vLLM cycles its drafts through them).",
            target.model,
            mtp_layer_count(arch),
        )
    if target.is_gguf:
        raise _error("method 'mtp' reads the layer from a safetensors checkpoint, not GGUF.")
    name = values.get("model")
    if name is not None:
        path = resolve("MTP checkpoint (speculative_config.model)", name, values.get("revision"))
        if os.path.realpath(path) != os.path.realpath(target.model):
            raise _error(
                f"method 'mtp' reads the target's own layers; \"model\" ({name}) must be the "
                f"target ({target.model}) or left out."
            )


def _with_policy(config: SpeculativeConfig, values: dict[str, Any]) -> SpeculativeConfig:
    if "disable_by_batch_size" in values:
        config = replace(config, disable_by_batch_size=_int(values, "disable_by_batch_size", 1))
    if "min_acceptance_rate" in values:
        rate = values["min_acceptance_rate"]
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
            raise _error(f"min_acceptance_rate must be a number in [0, 1], got {rate!r}.")
        config = replace(config, min_acceptance_rate=float(rate))
    return config


def _with_ngram(config: SpeculativeConfig, values: dict[str, Any]) -> SpeculativeConfig:
    if values.get("model") is not None:
        raise _error('method "ngram" looks drafts up in the request itself; remove "model".')
    low = _int(values, "prompt_lookup_min", 1)
    high = _int(values, "prompt_lookup_max", 1)
    if low is None and high is None:
        low = high = 5  # vLLM's defaults
    low = high if low is None else low
    high = low if high is None else high
    assert low is not None and high is not None
    if low > high:
        raise _error(
            f"prompt_lookup_min={low} is larger than prompt_lookup_max={high}; "
            "make prompt_lookup_min <= prompt_lookup_max."
        )
    return replace(config, prompt_lookup_min=low, prompt_lookup_max=high)


def _with_acceptance(config: SpeculativeConfig, values: dict[str, Any]) -> SpeculativeConfig:
    rate = values.get("acceptance_rate")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
        raise _error(f"method 'acceptance' needs acceptance_rate in [0, 1], got {rate!r}.")
    path = values.get("reference_path")
    if not isinstance(path, str) or not path:
        raise _error(
            "method 'acceptance' (benchmarks) needs reference_path, a JSON file of "
            "[prompt_token_ids, continuation] pairs; `pagedlm bench latency "
            "--spec-acceptance A` writes it."
        )
    return replace(config, acceptance_rate=float(rate), reference_path=path)


def _draft_model(
    method: str, values: dict[str, Any], target: ModelConfig, resolve: Resolve
) -> ModelConfig:
    name = values.get("model")
    if not isinstance(name, str) or not name:
        raise _error(f'method {method!r} needs "model": the draft model or EAGLE head to load.')
    path = resolve("Draft model (speculative_config.model)", name, values.get("revision"))
    if path.endswith(".gguf"):
        if method != "draft_model":
            raise _error(f"an {method} head is a directory (config.json + weights), not {path}.")
        from pagedlm.model_executor.loader.gguf_loader import gguf_arch_config

        arch = gguf_arch_config(path)
    else:
        arch = ArchConfig.from_directory(path)
    _check_draft(method, arch, target, path)
    return ModelConfig(
        model=path,
        tokenizer=None,
        arch=arch,
        dtype=target.dtype,
        max_model_len=target.max_model_len,
        seed=target.seed,
        skip_tokenizer_init=True,
        load_format="dummy" if target.load_format == "dummy" else "auto",
        revision=values.get("revision"),
        enforce_eager=target.enforce_eager,
    )


def _check_draft(method: str, arch: ArchConfig, target: ModelConfig, path: str) -> None:
    """Start-up errors for a draft that cannot serve this target."""
    if arch.vocab_size != target.arch.vocab_size:
        raise _error(
            f"the draft model {path} has a vocabulary of {arch.vocab_size} tokens but the "
            f"target has {target.arch.vocab_size}; use a draft that shares the target's "
            "tokenizer (its vocab_size in config.json must match)."
        )
    if method == "draft_model":
        from pagedlm.model_executor.models.registry import SUPPORTED_ARCHITECTURES

        if arch.architecture not in SUPPORTED_ARCHITECTURES:
            raise _error(
                f"the draft model's architecture {arch.architecture!r} is not supported; "
                f"use one of {', '.join(sorted(SUPPORTED_ARCHITECTURES))}."
            )
        if arch.max_position_embeddings < target.max_model_len:
            raise _error(
                f"the draft model {path} holds {arch.max_position_embeddings} positions, fewer "
                f"than max_model_len={target.max_model_len}; lower --max-model-len to at most "
                f"{arch.max_position_embeddings} or use a draft with a longer context."
            )
        return
    target_hidden = arch.raw.get("target_hidden_size", arch.hidden_size)
    if target_hidden != target.arch.hidden_size:
        raise _error(
            f"the {method} head {path} was trained on hidden states of size {target_hidden}, "
            f"but the target's are {target.arch.hidden_size}; use the head trained for this "
            "target model."
        )
    if method == "eagle3" and "draft_vocab_size" not in arch.raw:
        raise _error(
            f"{path} is not an EAGLE-3 head (its config.json has no draft_vocab_size); "
            'use method "eagle" for an EAGLE-1 head.'
        )
