"""Request bodies of the pooling routes, with vLLM's fields: ``/classify``, ``/score``,
``/rerank`` (Jina's and Cohere's shape) and ``/pooling``; the input or chat form that
``/v1/embeddings`` shares with ``/classify`` and ``/pooling`` (``InputOrMessages``), and
the fields every one of them takes (``PoolingBodyFields``, vLLM's
``PoolingBasicRequestMixin``): ``cache_salt``, ``request_id``, ``priority``,
``truncation_side``, ``padding`` and ``mm_processor_kwargs``."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from pagedlm.entrypoints.openai.cache_salt import CacheSalt
from pagedlm.entrypoints.openai.chat_message import ChatMessage
from pagedlm.entrypoints.openai.errors import APIError
from pagedlm.entrypoints.openai.pooling_encoding import EmbedDType, EncodingFormat, Endianness
from pagedlm.entrypoints.openai.protocol import (
    INT64_MAX,
    INT64_MIN,
    ChatTemplateFields,
    OpenAIModel,
    engine_prompts,
)

_USE_ACTIVATION = "use use_activation, which means the same"
_TEXT_ONLY = "this server's pooling routes take texts and token ids, no images"


class PoolingBodyFields(OpenAIModel):
    """What every pooling body takes, as vLLM's do. ``cache_salt`` (``cache_salt.py``): the
    request's prompts share prefix-cache blocks only with prompts of the same salt;
    ``request_id``: the response's id (``<route prefix>-<request_id>``, an ``X-Request-Id``
    header winning) and its engine requests' (``...-<index>``); ``priority``: each engine
    request's (``--scheduling-policy priority``); ``truncation_side`` and ``padding``: how
    ``truncate_prompt_tokens`` cuts and how a prompt is padded
    (``pagedlm.engine.tokenization_kwargs``); ``mm_processor_kwargs``: refused unless empty
    (there is no image to process)."""

    cache_salt: CacheSalt = None
    request_id: str | None = Field(None, min_length=1, max_length=256)
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    truncation_side: Literal["left", "right"] | None = None
    """"left" keeps a cut prompt's last tokens, "right" its first (None: a text keeps its
    first, a token-id prompt its last)."""
    padding: Literal["max_length", "do_not_pad"] | None = None
    """"max_length": each prompt padded with the pad token to ``truncate_prompt_tokens``,
    else to ``max_model_len``."""
    mm_processor_kwargs: dict[str, Any] | None = None

    def tokenization_kwargs(self, add_special_tokens: bool = True) -> dict[str, Any] | None:
        """How the engine tokenizes, cuts and pads the prompts (None: as it does by default)."""
        if self.mm_processor_kwargs:
            raise APIError(
                f"mm_processor_kwargs is for image inputs, and {_TEXT_ONLY}: drop it.",
                param="mm_processor_kwargs",
            )
        kwargs: dict[str, Any] = {
            "truncation_side": self.truncation_side,
            "padding": self.padding,
            "add_special_tokens": None if add_special_tokens else False,
        }
        kwargs = {key: value for key, value in kwargs.items() if value is not None}
        return kwargs or None


class InputOrMessages(OpenAIModel):
    """``input`` (a text, texts, one token-id list, or token-id lists: one result each),
    or vLLM's chat form: ``messages``, one result for the conversation as the chat
    template renders it (``add_generation_prompt`` off unless asked)."""

    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None
    """vLLM's (the chat form's image loading): refused unless empty, as there are none."""
    add_special_tokens: bool | None = None
    """vLLM's: the tokenizer's special tokens (BOS, BERT's [CLS]/[SEP]) on text; None: as
    vLLM, true for ``input`` texts, false for ``messages`` (the template writes them)."""

    def prompts(self) -> list[str | dict[str, Any]]:
        """The input field as engine prompts (text or token ids)."""
        if self.input is None:
            raise APIError("Send input (texts or token ids) or messages (a chat).", param="input")
        return engine_prompts(self.input, "input")

    def chat(self) -> ChatTemplateFields | None:
        """The chat form's fields (None: the request sends ``input``)."""
        if self.media_io_kwargs:
            raise APIError(
                f"media_io_kwargs is for image inputs, and {_TEXT_ONLY}: drop it.",
                param="media_io_kwargs",
            )
        if self.messages is None:
            return None
        if self.input is not None:
            raise APIError("Send input or messages, not both.", param="messages")
        if not self.messages:
            raise APIError("messages is empty; send at least one message.", param="messages")
        return ChatTemplateFields.model_construct(
            messages=self.messages,
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            chat_template=self.chat_template,
            chat_template_kwargs=self.chat_template_kwargs,
        )


class EncodingFields(OpenAIModel):
    """How the results go on the wire (``pooling_encoding``): OpenAI's
    ``encoding_format`` with vLLM's "bytes" and "bytes_only", and vLLM's ``embed_dtype`` and
    ``endianness`` of the binary forms."""

    encoding_format: EncodingFormat = "float"
    embed_dtype: EmbedDType = "float32"
    endianness: Endianness = "native"


class ActivationFields(OpenAIModel):
    """``use_activation`` (None: the model's activation applies; False: raw logits), the
    older names vLLM still reads, and ``truncate_prompt_tokens``."""

    deprecated_fields: ClassVar[dict[str, str]] = {
        "activation": _USE_ACTIVATION,
        "softmax": _USE_ACTIVATION,
    }
    use_activation: bool | None = None
    activation: bool | None = None
    softmax: bool | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    """At most this many tokens per prompt (-1: ``max_model_len``), as ``PoolingParams``."""

    def activation_choice(self) -> bool | None:
        for value in (self.use_activation, self.activation, self.softmax):
            if value is not None:
                return value
        return None


class ClassificationRequest(InputOrMessages, ActivationFields, PoolingBodyFields):
    model: str | None = None
    user: str | None = None


SCORE_FIELD_PAIRS = (
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
    ("text_1", "text_2"),
)
"""The names ``/score`` takes its two sides under, in vLLM's order of preference."""


class ScoreRequest(ActivationFields, PoolingBodyFields):
    """The two sides of the scores under any of vLLM's names (``SCORE_FIELD_PAIRS``): the
    first side one text (scored against every text of the second) or as many as the
    second (pairwise). As in vLLM, the first complete pair is read and the others'
    fields are ignored."""

    model: str | None = None
    user: str | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    items: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None

    def sides(self) -> tuple[tuple[str, str], str | list[str], str | list[str]]:
        """(the pair's names, its first side, its second side); a 400 naming the pairs
        when none is complete."""
        for names in SCORE_FIELD_PAIRS:
            first, second = (getattr(self, name) for name in names)
            if first is not None and second is not None:
                return names, first, second
        sent = {n for pair in SCORE_FIELD_PAIRS for n in pair if getattr(self, n) is not None}
        missing = next((b if a in sent else a for a, b in SCORE_FIELD_PAIRS if {a, b} & sent), None)
        pairs = ", ".join(f"{a} with {b}" for a, b in SCORE_FIELD_PAIRS)
        raise APIError(
            f"Send the texts to score as one of these pairs: {pairs} (this request has "
            f"{sorted(sent) or 'none of them'}).",
            param=missing or "queries",
        )


class RerankRequest(ActivationFields, PoolingBodyFields):
    model: str | None = None
    user: str | None = None
    query: str
    documents: list[str]
    top_n: int = Field(0, ge=0)
    """Return the best this many documents (0: all of them), best first."""


class PoolingRequest(InputOrMessages, ActivationFields, EncodingFields, PoolingBodyFields):
    """The model's pooled output as it is: an embedding, or a classifier's probabilities;
    with ``task`` (vLLM's) "token_embed" or "token_classify", one row per prompt token."""

    model: str | None = None
    task: str | None = None
    """The pooling task (``pagedlm.pooling.tasks``; None: the model's own)."""
    dimensions: int | None = Field(None, ge=1)
    normalize: bool | None = None
    user: str | None = None
