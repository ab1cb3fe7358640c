"""What ``LLM``'s methods take, normalized and checked before anything reaches the engine:
prompts as a list, parameters and LoRA requests one per prompt, chat conversations as
lists of message dicts. Every refusal is a TypeError or ValueError that names the argument
and what it takes (vLLM's names)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from pagedlm.engine.input_processor import PromptType
from pagedlm.lora.request import LoRARequest
from pagedlm.pooling import PoolingParams
from pagedlm.sampling_params import SamplingParams

UseTqdm = bool | Callable[..., Any]
"""vLLM's ``use_tqdm``: a progress bar or none, or the callable that makes it (e.g.
``functools.partial(tqdm, leave=False)``)."""


def prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not isinstance(prompts, Iterable):
        raise TypeError(
            f"prompts must be a string, a prompt dict ({{'prompt': str}} or "
            f"{{'prompt_token_ids': [int, ...]}}) or a list of them, got "
            f"{type(prompts).__name__}."
        )
    return list(prompts)


ParamsT = TypeVar("ParamsT", SamplingParams, PoolingParams)


def check_conversations(conversations: Any) -> None:
    """``chat``'s messages: a conversation (a list of message dicts with a ``role``) or a
    list of them; anything else is a TypeError naming the message, instead of an error
    from deep inside the chat template."""
    if isinstance(conversations, (str, bytes, dict)) or not isinstance(conversations, Sequence):
        raise TypeError(
            "messages must be a conversation (a list of {'role': ..., 'content': ...} "
            f"dicts) or a list of conversations, got {type(conversations).__name__}."
        )
    for i, conversation in enumerate(conversations):
        if isinstance(conversation, (str, bytes)) or not isinstance(conversation, Sequence):
            raise TypeError(
                f"messages[{i}] must be a list of message dicts, got "
                f"{type(conversation).__name__}: {conversation!r:.60}."
            )
        for j, message in enumerate(conversation):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise TypeError(
                    f"message {j} of conversation {i} must be a dict with a 'role' (and its "
                    f"'content'), got {message!r:.80}."
                )
            content = message.get("content")
            if content is not None and not isinstance(content, (str, list)):
                raise TypeError(
                    f"message {j} of conversation {i}: content must be a string or a list "
                    f"of content parts, got {type(content).__name__}."
                )


def one_per_prompt(
    params: ParamsT | Sequence[ParamsT], num_prompts: int, kind: type[ParamsT]
) -> list[ParamsT]:
    """``params`` (a ``kind``) for every prompt, or the list of one per prompt it already is."""
    name = kind.__name__
    argument = "sampling_params" if kind is SamplingParams else "pooling_params"
    if isinstance(params, kind):
        return [params] * num_prompts
    if not isinstance(params, Iterable) or isinstance(params, str | Mapping):
        raise TypeError(
            f"{argument} must be a {name} or a list of one per prompt, got {type(params).__name__}."
        )
    params_list = list(params)
    wrong = [p for p in params_list if not isinstance(p, kind)]
    if wrong:
        raise TypeError(
            f"{argument} must be a {name} or a list of one per prompt, got a list holding a "
            f"{type(wrong[0]).__name__}."
        )
    if len(params_list) != num_prompts:
        raise ValueError(
            f"Got {len(params_list)} {name} for {num_prompts} prompts; pass one {name} or "
            "exactly one per prompt."
        )
    return params_list


def per_prompt(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise ValueError(
            f"Got {len(loras)} LoRA requests for {num_prompts} prompts; pass one "
            "LoRARequest or exactly one (or None) per prompt."
        )
    return loras
