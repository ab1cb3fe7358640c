"""Request bodies of the OpenAI-compatible endpoints (pydantic), with vLLM's extra fields.

Unknown fields are ignored (and reported, see ``request_body``), as OpenAI's SDKs send
fields a server may not know. The documented ranges of the sampling fields are declared
here too, so ``/openapi.json`` shows them (``SamplingParams`` checks them again for Python
callers), with API-level limits and what must fit the engine's 64-bit wire format;
``base_sampling_params`` turns a request into engine parameters.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import (
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
)
from pydantic_core import PydanticCustomError

from pagedlm.beam_search import BeamSearchParams
from pagedlm.entrypoints.openai.cache_salt import CacheSalt, salted
from pagedlm.entrypoints.openai.chat_message import ChatMessage
from pagedlm.entrypoints.openai.errors import APIError, from_value_error
from pagedlm.entrypoints.openai.request_body import RequestModel
from pagedlm.entrypoints.openai.structured_request import (
    GUIDED_FIELDS,
    GrammarCheck,
    structured_outputs_from_request,
)
from pagedlm.generation_config import request_fields
from pagedlm.sampling_params import (
    MAX_TEMPERATURE,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

MAX_N = 64
"""The most samples one request may ask for (``n``)."""
LOGIT_BIAS_LIMIT = 100.0
"""A request's ``logit_bias`` values are clamped to +-this (OpenAI's documented range;
vLLM clamps them when it builds a request's sampling parameters, ``SamplingParams`` does
not)."""
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""``seed`` and ``priority`` range (vLLM's: a torch.long)."""


class OpenAIModel(RequestModel):
    """Every request model of this API."""


class StreamOptions(OpenAIModel):
    field_path = "stream_options"
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's: with ``include_usage``, every chunk carries its choice's usage so far."""


class SamplingFields(OpenAIModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's and vLLM's)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = Field(None, ge=-1)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    """vLLM's: the side ``truncate_prompt_tokens`` cuts, token ids and embeddings' rows
    alike ("left": the last kept, the default for generation; "right": the first)."""
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    return_token_ids: bool | None = None
    """Also answer with the prompt's and each choice's token ids (streamed: the prompt's in
    the first chunk, each chunk's new ones)."""
    return_tokens_as_token_ids: bool | None = None
    """Write logprobs' tokens as ``"token_id:<id>"``."""
    use_beam_search: bool = False
    """Beam search (``n`` beams, the choices best first) instead of sampling."""
    length_penalty: float = 1.0
    """Beam search: a beam's score is its cumulative logprob over its length to this."""
    cache_salt: CacheSalt = None
    request_id: str | None = Field(None, min_length=1, max_length=256)
    """The id the response carries (``cmpl-<request_id>``); an ``X-Request-Id`` header
    wins over it (vLLM's order)."""
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    """Arguments for the server's custom logits processors (``SamplingParams.extra_args``)."""
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's deprecated spellings of structured_outputs
    guided_json: dict[str, Any] | str | None = Field(None, json_schema_extra={"deprecated": True})
    guided_choice: list[str] | None = Field(None, json_schema_extra={"deprecated": True})
    guided_regex: str | None = Field(None, json_schema_extra={"deprecated": True})
    guided_grammar: str | None = Field(None, json_schema_extra={"deprecated": True})
    guided_decoding_backend: str | None = Field(None, json_schema_extra={"deprecated": True})

    deprecated_fields: ClassVar[dict[str, str]] = {
        **{
            name: f'send structured_outputs={{"{key}": ...}} instead'
            for name, key in GUIDED_FIELDS.items()
        },
        "guided_decoding_backend": "the server's --structured-outputs-backend is used; drop it",
    }

    @field_validator("stream_options", mode="before")
    @classmethod
    def _check_stream_options(cls, value: Any, info: ValidationInfo) -> Any:
        """vLLM's rule: ``stream_options`` only with ``stream=true`` (an empty or null one
        is not refused, as there). ``stream`` is declared first, so it is in ``info.data``."""
        if value and not info.data.get("stream"):
            raise PydanticCustomError(
                "stream_options",
                "stream_options can only be sent with stream=true; send stream=true or "
                "drop stream_options.",
            )
        return value

    @field_validator("logit_bias", mode="wrap")
    @classmethod
    def _check_logit_bias(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """pydantic's checks of the values, refused with a message that says what to send
        (a finite number; strict JSON already refuses NaN and Infinity)."""
        try:
            return handler(value)
        except ValidationError as error:
            if not isinstance(value, dict):
                raise PydanticCustomError(
                    "logit_bias",
                    'send an object mapping token ids to biases, e.g. {"50256": -100}.',
                ) from None
            key = next((str(e["loc"][0]) for e in error.errors() if e["loc"]), None)
            got = repr(value.get(key))[:64]  # client-chosen: quoted short
            raise PydanticCustomError(
                "logit_bias",
                f"the bias of token {key!s:.32} is {got}; send a finite number from "
                f"-{LOGIT_BIAS_LIMIT:g} to {LOGIT_BIAS_LIMIT:g} (larger ones are clamped).",
            ) from None

    def tokenization_kwargs(self) -> dict[str, Any] | None:
        """The engine's ``tokenization_kwargs`` for this request (None: the defaults)."""
        return None if self.truncation_side is None else {"truncation_side": self.truncation_side}

    def check_backend(self, server_backend: str) -> None:
        """vLLM's rule for ``guided_decoding_backend``: a request cannot pick its grammar
        backend; naming the server's own (options after ":" aside) is accepted."""
        requested = self.guided_decoding_backend
        if requested is not None and requested.split(":")[0] != server_backend:
            raise APIError(
                f"guided_decoding_backend={requested!r}: a request cannot choose the grammar "
                f"backend; this server uses {server_backend!r} (--structured-outputs-backend). "
                "Drop the field.",
                param="guided_decoding_backend",
            )

    def base_sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        structured_outputs: StructuredOutputsParams | None = None,
        defaults: Mapping[str, Any] | None = None,
        keep_special_tokens: bool = False,
        *,
        grammar: GrammarCheck,
    ) -> SamplingParams:
        """Engine parameters for this request; bad values -> ``APIError`` 400.

        ``structured_outputs`` (forced tool calls) replaces the request's own
        ``response_format``/``structured_outputs``/``guided_*``, which are checked against
        the server's ``grammar`` backend. ``defaults``: the model's sampling
        defaults (``ModelConfig.sampling_defaults``) for the fields the request leaves unset.
        ``keep_special_tokens``: a parser reads markers that are special tokens, so the text
        keeps them whatever ``skip_special_tokens`` says (vLLM's parsers do the same).
        """
        if structured_outputs is None:
            structured_outputs = structured_outputs_from_request(
                self.response_format, self.structured_outputs, grammar, self.guided_fields()
            )
        requested = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "max_tokens": max_tokens,
        }
        try:
            return SamplingParams(
                n=self.n,
                **request_fields(requested, defaults or {}),
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                seed=self.seed,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=self.prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens and not keep_special_tokens,
                spaces_between_special_tokens=self.spaces_between_special_tokens,
                logit_bias=self._logit_bias(),
                include_stop_str_in_output=self.include_stop_str_in_output,
                output_kind=RequestOutputKind.DELTA,
                structured_outputs=structured_outputs,
                truncate_prompt_tokens=self.truncate_prompt_tokens,
                allowed_token_ids=self.allowed_token_ids,
                bad_words=self.bad_words,
                extra_args=self.vllm_xargs,
            )
        except ValueError as error:
            raise from_value_error(error) from error

    def beam_search_params(
        self, max_tokens: int | None, max_model_len: int
    ) -> BeamSearchParams | None:
        """With ``use_beam_search``, the search's parameters (``n`` beams); else None. What
        beam search cannot honour is a 400 naming it."""
        if not self.use_beam_search:
            return None
        unsupported = {
            "stop": bool(self.stop),
            "response_format": self.response_format is not None,
            "structured_outputs": self.asks_structured_outputs,
            "logit_bias": bool(self.logit_bias),
            "bad_words": bool(self.bad_words),
            "allowed_token_ids": self.allowed_token_ids is not None,
            "min_tokens": self.min_tokens > 0,
        }
        for name, is_set in unsupported.items():
            if is_set:
                raise APIError(
                    f"use_beam_search does not combine with {name}; drop one of them.",
                    param=name,
                )
        try:
            return BeamSearchParams(
                beam_width=self.n,
                max_tokens=max_tokens or max_model_len,
                ignore_eos=self.ignore_eos,
                temperature=self.temperature or 0.0,
                length_penalty=self.length_penalty,
                include_stop_str_in_output=self.include_stop_str_in_output,
            )
        except ValueError as error:  # n is the beam width
            raise APIError(f"use_beam_search with n={self.n}: {error}", param="n") from None

    def guided_fields(self) -> dict[str, Any]:
        """The deprecated ``guided_*`` fields sent, by name."""
        sent = {name: getattr(self, name) for name in GUIDED_FIELDS}
        return {name: value for name, value in sent.items() if value is not None}

    @property
    def asks_structured_outputs(self) -> bool:
        """``structured_outputs`` or a deprecated ``guided_*`` field was sent."""
        return self.structured_outputs is not None or bool(self.guided_fields())

    def engine_prompts(self, prompts: list[str | dict[str, Any]]) -> list[str | dict[str, Any]]:
        """``prompts`` as the engine takes them, each carrying this request's
        ``cache_salt`` (requests with different salts never share prefix-cache blocks)."""
        return [salted(prompt, self.cache_salt) for prompt in prompts]

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        bias: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            try:
                token_id = int(key)
            except ValueError:
                raise APIError(
                    f"logit_bias key {key!r} is not a token id; use token ids as keys.",
                    param="logit_bias",
                ) from None
            bias[token_id] = min(max(float(value), -LOGIT_BIAS_LIMIT), LOGIT_BIAS_LIMIT)
        return bias

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        options = self.stream_options
        return options is not None and options.include_usage and options.continuous_usage_stats


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    prompt_embeds: str | list[str] | None = None
    """vLLM's: prompts as input embeddings, each the base64 of ``torch.save``'s bytes for
    a tensor ``[num_tokens, hidden_size]`` (``--enable-prompt-embeds``); their choices come
    before the ``prompt``'s."""
    suffix: str | None = None
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)
    best_of: int | None = None
    add_special_tokens: bool = True
    """vLLM's: the tokenizer's special tokens (BOS) on text prompts; false for a prompt
    that already holds them as text."""

    def prompts(self) -> list[str | dict[str, Any]]:
        """The prompt field as a list of engine prompts (text or token ids); empty when
        only ``prompt_embeds`` is given."""
        if self.prompt is None:
            if not self.prompt_embeds:
                raise APIError("prompt is required (or prompt_embeds).", param="prompt")
            return []
        return engine_prompts(self.prompt, "prompt")

    def embeds_list(self) -> list[str]:
        """``prompt_embeds`` as a list of base64 strings (empty: none given)."""
        value = self.prompt_embeds
        return [] if value is None else [value] if isinstance(value, str) else list(value)


def engine_prompts(
    value: str | list[str] | list[int] | list[list[int]], param: str
) -> list[str | dict[str, Any]]:
    """A text / texts / token ids / token-id lists field as engine prompts; a 400 naming
    ``param`` when it is empty. The field is validated: pydantic's union validates a list
    as one member, so its first item tells which kind all its items are (no pass over
    a million token ids on the event loop)."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise APIError(f"{param} is empty; pass a string or token ids.", param=param)
    first = value[0]
    if isinstance(first, int):
        return [{"prompt_token_ids": list(value)}]
    if isinstance(first, str):
        return list(value)
    if isinstance(first, list):
        return [{"prompt_token_ids": list(p)} for p in value]
    raise APIError(
        f"{param} must be a string, a list of strings, a list of token ids or a list of "
        "token-id lists; do not mix them.",
        param=param,
    )


RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "chat_template",
        "tokenize",
        "return_dict",
        "return_tensors",
        "add_generation_prompt",
        "continue_final_message",
        "tools",
        "documents",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
        "return_assistant_tokens_mask",
    }
)


class ChatTemplateFields(OpenAIModel):
    """A conversation and how the chat template renders it (chat completions, and
    vLLM's chat-form embedding and pooling requests)."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    """vLLM's: documents the chat template shows the model (retrieval-augmented
    generation), for templates that read ``documents``."""

    def conversation(self) -> list[dict[str, Any]]:
        return [m.template_message(f"messages.{i}") for i, m in enumerate(self.messages)]

    def template_kwargs(self) -> dict[str, Any]:
        kwargs = checked_template_kwargs(
            self.chat_template_kwargs, self.add_generation_prompt, self.continue_final_message
        )
        if self.documents is not None:
            kwargs["documents"] = self.documents
        return kwargs


def checked_template_kwargs(
    chat_template_kwargs: dict[str, Any] | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
) -> dict[str, Any]:
    """A request's ``chat_template_kwargs`` (a copy), refused where they set what the
    server sets itself or where the two prompt options conflict."""
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise APIError(
            f"chat_template_kwargs may not set {reserved}: the server sets these itself; "
            "use the request's own fields (e.g. add_generation_prompt) instead.",
            param="chat_template_kwargs",
        )
    if continue_final_message and add_generation_prompt:
        raise APIError(
            "continue_final_message=true continues the last message; send "
            "add_generation_prompt=false with it.",
            param="continue_final_message",
        )
    return kwargs


class ChatCompletionRequest(ChatTemplateFields, SamplingFields):
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    """OpenAI's field, handed to the chat template (which may read it, as gpt-oss's does)."""
    mm_processor_kwargs: dict[str, Any] | None = None
    """vLLM's: options for the model's image processor, over ``--mm-processor-kwargs``."""
    add_special_tokens: bool = False
    """vLLM's: the tokenizer's special tokens (BOS) on top of what the chat template
    writes (most templates write them; true would then double them)."""
    echo: bool = False
    """vLLM's: when the last message has the reply's role (``reply_role``), each choice's
    content starts with that message's text; non-streaming answers also carry the
    prompt's ``prompt_logprobs`` (``top_logprobs`` of them, unless ``prompt_logprobs``
    says otherwise)."""

    def reply_role(self, response_role: str) -> str:
        """The role the reply is given (vLLM's rule): the server's ``--response-role``
        after a generation prompt, else the last message's (the reply continues it)."""
        return response_role if self.add_generation_prompt else self.messages[-1].role

    def echoed_text(self, role: str) -> str:
        """What ``echo`` puts before each choice's content: the last message's text (its
        text parts joined by newlines) when it has the reply's ``role``, else ""."""
        last = self.messages[-1]
        if not self.echo or last.role != role:
            return ""
        return "\n".join(last.texts())

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise APIError("top_logprobs needs logprobs=true.", param="top_logprobs")
            return None
        return self.top_logprobs or 0


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    """The tokenizer's BOS and the like; unset, vLLM's defaults: true for a prompt, false
    for messages (the chat template writes its own)."""
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    """Also answer with each token's string (vLLM's ``token_strs``)."""
    # With messages, vLLM's chat-tokenize fields: the prompt a chat request would send.
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    """With messages that hold images, the model's image processor options (as a chat
    request's); a prompt ignores them, as vLLM's completion-style tokenize request does."""


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]
