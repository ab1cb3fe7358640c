"""Per-request sampling parameters, with vLLM's names, defaults and error semantics.

Validation happens here, once, when the object is built: a bad value raises
``ValueError`` naming the field and the fix before the request reaches the engine.
"""

from __future__ import annotations

import enum
import functools
import json as _json
import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

MAX_LOGPROBS = 20
"""Upper bound for ``logprobs`` and ``prompt_logprobs`` (the OpenAI API's cap)."""
MAX_TEMPERATURE = 2.0
"""vLLM's (and OpenAI's) upper bound: hotter sampling is noise."""
MAX_LOGIT_BIAS = 1e30
"""Larger biases overflow float32 logits to infinities, whose softmax is NaN."""
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
"""What a torch generator's ``manual_seed`` takes (and the engine's wire format carries)."""
_FLOAT_FIELDS = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "min_p",
)
_OPTIONAL_INT_FIELDS = ("seed", "max_tokens", "logprobs", "prompt_logprobs")
_BOOL_FIELDS = (
    "ignore_eos",
    "detokenize",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
)


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    """Every output carries the whole text and token ids generated so far."""
    DELTA = 1
    """Every output carries only what is new since the previous one."""
    FINAL_ONLY = 2
    """Only the finished output is returned."""


_STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a JSON schema, any JSON object, a regex, a choice, an EBNF
    grammar or a structural tag.

    Exactly one of ``json`` (a schema as dict or JSON string), ``json_object=True``,
    ``regex``, ``choice`` (list of strings), ``grammar`` (EBNF) or ``structural_tag`` must
    be set. Field names follow vLLM. ``structural_tag`` (a JSON string, xgrammar only):
    free text in which each tag's ``begin`` (once the output reaches one of ``triggers``)
    is followed by JSON of its ``schema`` and its ``end``, in vLLM's
    ``{"type": "structural_tag", "structures": [...], "triggers": [...]}`` form or
    xgrammar's own (``{"type": "structural_tag", "format": {...}}``). Checks that need a
    grammar backend (is the regex valid? does the grammar parse?) run in the input
    processor, before the request enters the engine.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    """JSON only: emit compact JSON (no free whitespace between tokens); small models may
    otherwise spend their tokens on whitespace."""

    def __post_init__(self) -> None:
        given = [name for name in _STRUCTURED_KINDS if self._is_set(name)]
        if len(given) != 1:
            found = ", ".join(given) if given else "none"
            raise ValueError(
                "StructuredOutputsParams needs exactly one of json, json_object=True, regex, "
                f"choice, grammar or structural_tag; got {found}."
            )
        if self.json_object is False:
            raise ValueError("json_object must be True or None.")
        # The engine core decodes these with their declared types: a wrong type would
        # fail there, for every request in flight, rather than here for this one.
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(
                f"structured_outputs.json_object must be true or null, got {self.json_object!r}."
            )
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(
                "structured_outputs.disable_any_whitespace must be true or false, got "
                f"{self.disable_any_whitespace!r}."
            )
        if isinstance(self.json, str):
            try:
                parsed = _json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            if not isinstance(parsed, dict | bool):
                raise ValueError("structured_outputs.json must be a JSON schema object.")
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError(
                f"structured_outputs.json must be a dict or a JSON string, got "
                f"{type(self.json).__name__}."
            )
        if self.choice is not None:
            # Not list() of any iterable: "ab" would silently be the choices "a" and "b".
            if not isinstance(self.choice, list | tuple):
                raise ValueError(
                    "structured_outputs.choice must be a non-empty list of strings, got "
                    f"{type(self.choice).__name__}."
                )
            self.choice = list(self.choice)
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings.")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            # A regex of whitespace matches that whitespace; a blank grammar or tag is empty.
            blank = not value if name == "regex" else not (isinstance(value, str) and value.strip())
            if value is not None and (not isinstance(value, str) or blank):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string.")
        if self.structural_tag is not None:
            try:
                tag = _json.loads(self.structural_tag)
            except ValueError as exc:
                raise ValueError(
                    f"structured_outputs.structural_tag is not valid JSON: {exc}"
                ) from None
            if not isinstance(tag, dict):
                raise ValueError("structured_outputs.structural_tag must be a JSON object.")

    def _is_set(self, name: str) -> bool:
        value = getattr(self, name)
        return value is not None and (name != "json_object" or value is not False)

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "json_object", "regex", "choice", "grammar" or
        "structural_tag"."""
        return next(name for name in _STRUCTURED_KINDS if self._is_set(name))


def check_truncate_prompt_tokens(value: object) -> None:
    """``truncate_prompt_tokens`` is None, -1 (up to ``max_model_len``) or a count >= 1."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
        raise ValueError(
            f"truncate_prompt_tokens must be -1 (truncate to max_model_len) or a positive "
            f"integer, got {value!r}."
        )


def _integer(name: str, value: object) -> int:
    """``value`` as an ``int``: any integer type (NumPy's too), never a bool or a float."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)  # type: ignore[call-overload]
        except TypeError:
            pass
    raise ValueError(f"{name} must be an integer, got {value!r}.")


def _token_id_list(name: str, value: object) -> list[int]:
    if isinstance(value, str | bytes | Mapping) or not hasattr(value, "__iter__"):
        raise ValueError(f"{name} must be a list of token ids (integers), got {value!r}.")
    try:
        return [_integer(name, token_id) for token_id in value]
    except ValueError:
        raise ValueError(f"{name} must be integers, got {value!r}.") from None


def _string_list(name: str, value: object) -> list[str]:
    if isinstance(value, bytes | Mapping) or not hasattr(value, "__iter__"):
        raise ValueError(f"{name} must be a string or a list of strings, got {value!r}.")
    strings = list(value)
    if not all(isinstance(s, str) for s in strings):
        raise ValueError(f"{name} must be a string or a list of strings, got {value!r}.")
    return strings


def _logit_bias(value: object) -> dict[int, float]:
    """Token id -> bias; ids may be strings of digits (JSON object keys, as OpenAI's)."""
    usage = "logit_bias must map token ids (integers) to numbers, e.g. {50256: -100}"
    if not isinstance(value, Mapping):
        raise ValueError(f"{usage}; got {value!r}.")
    bias = {}
    for token_id, amount in value.items():
        try:
            if isinstance(token_id, bool) or isinstance(amount, bool | str):
                raise TypeError
            key = int(token_id) if isinstance(token_id, str) else operator.index(token_id)
            bias[key] = float(amount)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ValueError(f"{usage}; got {token_id!r}: {amount!r}.") from None
    return bias


PER_REQUEST_LOGITS_PROCESSORS = (
    "SamplingParams(logits_processors=...) is not supported: like vLLM v1, pagedlm takes no "
    "per-request logits processors. Pass a custom logits processor class to the engine "
    "instead "
    "(LLM(logits_processors=[MyProcessor]), or --logits-processors package.module:Class for "
    "the server), a subclass of pagedlm.sample.logits_processor.LogitsProcessor that reads "
    "each request's arguments from SamplingParams.extra_args; AdapterLogitsProcessor turns "
    "a per-request callable into one (docs/logits_processors.md)."
)


@dataclass
class SamplingParams:
    """How to sample one request. Field names and defaults follow vLLM.

    ``temperature == 0`` means greedy. ``top_k == -1`` and ``top_p == 1`` disable those
    filters (``top_k == 0`` means -1, as in vLLM). ``seed`` makes the request's samples
    independent of what else is batched (with speculative decoding, only as long as the
    drafts its steps verify are: they depend on the batch and the token budget, and each
    verified draft takes a draw); it may be any 64-bit integer, signed or unsigned.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    """Sample only among these tokens (vLLM's field); None: the whole vocabulary."""
    bad_words: list[str] | None = None
    """Words never to generate (vLLM's field): each word's tokens, with and without a
    leading space; a word of several tokens is blocked at its last token once the output
    ends with the others."""
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    truncate_prompt_tokens: int | None = None
    """Keep only the prompt's last this many tokens (left truncation); -1: as many as
    ``max_model_len``; None: no truncation (vLLM's field)."""
    extra_args: dict[str, Any] | None = None
    """Arguments for custom logits processors and other extensions, which read them from
    here (vLLM's field; ``vllm_xargs`` over HTTP); the engine itself reads none."""
    # Filled by the engine from the tokenizer/model: EOS plus any extra ids that end the request.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    # Filled by the engine from the tokenizer: ``bad_words`` as token sequences.
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    logits_processors: ClassVar[None] = None
    """vLLM's per-request callables: always None here, since the constructor refuses them
    (``_refusing_logits_processors``); no field, so nothing the wire carries (msgspec
    takes no ``InitVar``)."""

    def __post_init__(self) -> None:
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = _string_list("stop", self.stop)
        for name in ("logprobs", "prompt_logprobs"):
            if isinstance(getattr(self, name), bool):  # vLLM's: True, the sampled token's alone
                setattr(self, name, int(getattr(self, name)))
        self._normalize_types()
        # Order kept, duplicates dropped (vLLM's semantics).
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids or []))
        if self.seed == -1:  # vLLM's spelling of "no seed"
            self.seed = None
        if self.top_k == 0:
            self.top_k = -1
        self._validate()
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(dict.fromkeys(self.allowed_token_ids))
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _normalize_types(self) -> None:
        """Every field as the type it is declared with (NumPy integers become ``int``):
        the engine core decodes requests with these types, and a wrong one would fail
        there, for every request in flight, rather than here for this one."""
        for name in ("n", "top_k", "min_tokens"):
            setattr(self, name, _integer(name, getattr(self, name)))
        for name in _OPTIONAL_INT_FIELDS:
            if getattr(self, name) is not None:
                setattr(self, name, _integer(name, getattr(self, name)))
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if isinstance(value, np.bool_):  # NumPy's, from a sweep over np.array values
                setattr(self, name, bool(value))
            elif not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}.")
        for name in ("stop_token_ids", "allowed_token_ids"):
            if getattr(self, name) is not None:
                setattr(self, name, _token_id_list(name, getattr(self, name)))
        if self.bad_words is not None:
            self.bad_words = _string_list("bad_words", self.bad_words)
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(
                "output_kind must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY), "
                f"got {self.output_kind!r}."
            )

    def _validate(self) -> None:
        self._validate_numbers()
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}; "
                "use temperature=0 for greedy decoding."
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}; use 1 to disable it.")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}; use 0 to disable it.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if self.repetition_penalty <= 0.0:
            raise ValueError(
                f"repetition_penalty must be greater than 0, got {self.repetition_penalty}; "
                "use 1 to disable it."
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}; "
                "lower min_tokens or raise max_tokens."
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < -1:
                raise ValueError(
                    f"{name} must be -1 (the whole vocabulary) or at least 0, got {value}; the "
                    f"engine's max_logprobs (default {MAX_LOGPROBS}) caps it."
                )
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty.")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True; use stop_token_ids instead.")
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsParams, e.g. "
                "StructuredOutputsParams(json=schema)."
            )

    def _validate_numbers(self) -> None:
        """Types and finiteness first: NaN passes every range comparison."""
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{name} must be a number, got {value!r}.")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}.")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(
                f"seed must be a 64-bit integer (in [-2**63, 2**64 - 1]), got {self.seed}."
            )
        if self.logit_bias and not all(
            abs(v) <= MAX_LOGIT_BIAS for v in self.logit_bias.values()
        ):  # (NaN fails the comparison too)
            raise ValueError(
                f"logit_bias values must be finite numbers of at most {MAX_LOGIT_BIAS:g} in "
                "magnitude (-100 to 100 already forbids or forces a token)."
            )
        if self.bad_words is not None and not all(
            isinstance(word, str) and word.strip() for word in self.bad_words
        ):
            raise ValueError(f"bad_words must be non-empty strings, got {self.bad_words!r}.")
        if self.extra_args is not None and not (
            isinstance(self.extra_args, dict) and all(isinstance(k, str) for k in self.extra_args)
        ):
            raise ValueError(
                f"extra_args must be a dict with string keys, got {self.extra_args!r}."
            )
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError(
                "allowed_token_ids is empty, so no token could be sampled; name at least one, "
                "or pass None to allow every token."
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self) -> SamplingParams:
        from copy import deepcopy

        return deepcopy(self)


def _refusing_logits_processors(init: Any) -> Any:
    """The dataclass's ``__init__`` taking vLLM's ``logits_processors`` keyword, refused
    with ``PER_REQUEST_LOGITS_PROCESSORS`` when it asks for any (None and [] pass, as in
    vLLM); it was Python's TypeError on an unexpected keyword."""

    @functools.wraps(init)
    def __init__(self: SamplingParams, *args: Any, logits_processors: Any = None, **kwargs: Any):
        if logits_processors:
            raise ValueError(PER_REQUEST_LOGITS_PROCESSORS)
        init(self, *args, **kwargs)

    return __init__


SamplingParams.__init__ = _refusing_logits_processors(SamplingParams.__init__)  # type: ignore[method-assign]
