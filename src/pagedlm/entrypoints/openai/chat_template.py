"""Conversation -> prompt token ids, never on the event loop.

The server's own template (``--chat-template``, else the tokenizer's) is trusted: it
renders and the text is tokenized on a worker thread. A request's ``chat_template`` is
code written by the client: it is refused (vLLM's message and flag) unless the server
runs with ``--trust-request-chat-template``, and then renders in a ``TemplateSandbox``
worker process with time and size limits.

Every render takes the server's ``--default-chat-template-kwargs`` under the request's own
kwargs, and hands message content to the template in the format
``--chat-template-content-format`` names (``pagedlm.chat_content``; "auto": the one the
template reads).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from pagedlm.chat_content import (
    ContentFormatOption,
    check_continuable,
    format_conversation,
    resolve_content_format,
    template_source,
)
from pagedlm.entrypoints.openai.errors import APIError
from pagedlm.entrypoints.openai.template_sandbox import (
    MAX_TEMPLATE_CHARS,
    TemplateError,
    TemplateSandbox,
)

logger = logging.getLogger("pagedlm.server")

UNTRUSTED_TEMPLATE_MESSAGE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)
"""vLLM's words, so clients that handle vLLM's refusal handle ours."""


class ChatTemplateRenderer:
    def __init__(
        self,
        tokenizer: Any,
        server_template: str | None,
        trust_request_templates: bool,
        default_kwargs: dict[str, Any] | None = None,
        content_format: ContentFormatOption = "auto",
    ) -> None:
        self.tokenizer = tokenizer
        self.server_template = server_template
        self.trust_request_templates = trust_request_templates
        self.default_kwargs = dict(default_kwargs or {})
        """``--default-chat-template-kwargs`` (a request's own kwargs override them)."""
        self.content_format = content_format
        """``--chat-template-content-format``."""
        self._sandbox: TemplateSandbox | None = None
        self._logged_sources: set[str] = set()

    def start(self) -> None:
        """Start the sandbox's workers in the background if request templates are trusted
        (needs a running event loop)."""
        if self.trust_request_templates:
            self._get_sandbox().start()

    async def close(self) -> None:
        if self._sandbox is not None:
            await self._sandbox.shutdown()

    async def render(
        self,
        conversation: list[dict[str, Any]],
        request_template: str | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        template_kwargs: dict[str, Any],
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Raises ``APIError`` (400) for a refused, failing or too costly template.
        ``add_special_tokens`` (vLLM's request field): the tokenizer's BOS and the like on
        top of what the template wrote."""
        tokenizer = self.tokenizer
        template_kwargs = {**self.default_kwargs, **template_kwargs}
        if request_template is not None:
            if not self.trust_request_templates:
                raise APIError(UNTRUSTED_TEMPLATE_MESSAGE, param="chat_template")
            # Parsed, never run, here; one past the limit is refused by the sandbox.
            source = request_template if len(request_template) <= MAX_TEMPLATE_CHARS else None
            if self.content_format == "auto":
                conversation = await asyncio.to_thread(
                    self._formatted, conversation, source, continue_final_message
                )
            else:
                conversation = self._formatted(conversation, source, continue_final_message)
            try:
                text = await self._get_sandbox().render(
                    request_template,
                    conversation,
                    add_generation_prompt,
                    continue_final_message,
                    template_kwargs,
                )
            except TemplateError as error:
                raise APIError(str(error), param="chat_template") from error
            return await asyncio.to_thread(_encode, tokenizer, text, add_special_tokens)
        if self.server_template is None and getattr(tokenizer, "chat_template", None) is None:
            raise APIError(
                "The model's tokenizer has no chat template; start the server with "
                "--chat-template <file or string>, or use /v1/completions."
            )

        def render_and_encode() -> list[int]:
            source = template_source(tokenizer, self.server_template, template_kwargs.get("tools"))
            messages = self._formatted(conversation, source, continue_final_message, log=True)
            try:
                text = tokenizer.apply_chat_template(
                    messages,
                    chat_template=self.server_template,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    tokenize=False,
                    **template_kwargs,
                )
            except Exception as error:  # jinja2 errors, template raise_exception(...)
                raise APIError(f"The chat template failed on these messages: {error}") from error
            return _encode(tokenizer, text, add_special_tokens)

        return await asyncio.to_thread(render_and_encode)

    def _formatted(
        self,
        conversation: list[dict[str, Any]],
        source: str | None,
        continue_final_message: bool,
        log: bool = False,
    ) -> list[dict[str, Any]]:
        """``conversation`` with its content in the format for the template ``source``,
        checked for ``continue_final_message`` (``chat_content.check_continuable``)."""
        content_format = resolve_content_format(self.content_format, source)
        if log and self.content_format == "auto" and source not in self._logged_sources:
            self._logged_sources.add(source)  # type: ignore[arg-type]
            logger.info(
                "The chat template reads message content as %r (detected; "
                "--chat-template-content-format overrides this).",
                content_format,
            )
        try:
            formatted = format_conversation(conversation, content_format)
            if continue_final_message:
                check_continuable(formatted)
        except ValueError as error:
            raise APIError(str(error), param=getattr(error, "where", "messages")) from error
        return formatted

    def _get_sandbox(self) -> TemplateSandbox:
        if self._sandbox is None:
            tokens = self.tokenizer.special_tokens_map
            self._sandbox = TemplateSandbox({k: _plain(v) for k, v in tokens.items()})
        return self._sandbox


def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    # The template already wrote BOS and other special tokens as text (unless the request
    # asks for the tokenizer's too).
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def _plain(value: Any) -> Any:
    """A special token (str, AddedToken, or a list of them) as JSON for the sandbox."""
    return [str(v) for v in value] if isinstance(value, list | tuple) else str(value)
