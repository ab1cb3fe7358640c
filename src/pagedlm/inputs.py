"""The prompt shapes ``LLM`` and ``AsyncLLM`` take, as vLLM's ``vllm.inputs`` names them.

A prompt is a string, or a dict with the text (``TextPrompt``) or its token ids
(``TokensPrompt``); either dict may carry ``cache_salt`` (requests with different salts
never share prefix-cache blocks), and a text prompt ``multi_modal_data``
(``{"image": PIL image or list}``) with ``mm_processor_kwargs`` for the image processor.
An engine started with ``enable_prompt_embeds=True`` also takes the prompt's input
embeddings (``EmbedsPrompt``).
The TypedDicts only describe the dicts: plain dicts are what the engine reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from typing_extensions import NotRequired, TypedDict


class TextPrompt(TypedDict):
    prompt: str
    multi_modal_data: NotRequired[dict[str, Any]]
    mm_processor_kwargs: NotRequired[dict[str, Any]]
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    """The text the ids came from, reported back in the output (never re-tokenized)."""
    multi_modal_data: NotRequired[dict[str, Any]]
    mm_processor_kwargs: NotRequired[dict[str, Any]]
    cache_salt: NotRequired[str]


class EmbedsPrompt(TypedDict):
    """A prompt as input embeddings (engines with ``enable_prompt_embeds=True``): a torch
    tensor ``[num_tokens, hidden_size]`` of what the model's input embedding layer gives
    (transformers' ``get_input_embeddings()``); ``pagedlm.engine.prompt_embeds``."""

    prompt_embeds: Any
    cache_salt: NotRequired[str]


SingletonPrompt = str | TextPrompt | TokensPrompt | EmbedsPrompt
PromptType = str | Mapping[str, Any]
"""What the engine accepts: a string or any mapping of the keys above."""

__all__ = ["EmbedsPrompt", "PromptType", "SingletonPrompt", "TextPrompt", "TokensPrompt"]
