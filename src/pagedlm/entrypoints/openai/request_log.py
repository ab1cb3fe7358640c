"""The server's per-request log lines (vLLM's flags): ``--enable-log-requests`` logs what
each engine request received, ``--enable-log-outputs`` what it generated (with
``--enable-log-deltas``, each streamed piece too). Logged text is cut to ``--max-log-len``
characters.

What a line shows of a prompt is what vLLM's request logger shows: its text, token ids
and embeddings' shape (and here its images or texts pair), never its ``cache_salt``, a
secret that keeps one tenant from probing another's prefix-cache blocks. Headers (the API
key among them) are never logged."""

from __future__ import annotations

import logging
from typing import Any

from pagedlm.outputs import RequestOutput

logger = logging.getLogger("pagedlm.server")


def cut(text: str, max_len: int) -> str:
    return text if len(text) <= max_len else text[:max_len] + "..."


def _head(value: Any, max_len: int) -> Any:
    """``value`` with every string cut to ``max_len`` characters and every list or tuple to
    ``max_len`` items (dicts' values likewise), as vLLM's request logger cuts a prompt's
    text and ids before formatting them: a line's first ``max_len`` characters need no
    more, and a prompt of millions of ids is not formatted whole on the event loop."""
    if isinstance(value, str):
        return value[: max_len + 1]
    if isinstance(value, (list, tuple)):
        items = [_head(item, max_len) for item in value[: max_len + 1]]
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, dict):
        return {key: _head(item, max_len) for key, item in value.items()}
    return value


def shown(value: Any, max_len: int) -> str:
    """``value``'s repr cut to ``max_len`` characters, formatting no more than that needs."""
    return cut(repr(_head(value, max_len)), max_len)


UNLOGGED_PROMPT_KEYS = frozenset({"cache_salt"})
"""Engine-prompt keys a log line leaves out: secrets."""


def loggable_prompt(prompt: Any) -> Any:
    """``prompt`` as a log line shows it: without its secrets, embeddings as their shape,
    and a text prompt that only carried a salt as the text alone (as if unsalted)."""
    if not isinstance(prompt, dict):
        return prompt
    shown = {key: value for key, value in prompt.items() if key not in UNLOGGED_PROMPT_KEYS}
    embeds = shown.get("prompt_embeds")
    if hasattr(embeds, "shape"):
        shown["prompt_embeds"] = f"<embeddings of shape {list(embeds.shape)}>"
    return shown["prompt"] if shown.keys() == {"prompt"} else shown


def log_received(request_id: str, prompt: Any, params: Any, max_len: int) -> None:
    logger.info(
        "Received request %s: prompt %s, params %s",
        request_id,
        shown(loggable_prompt(prompt), max_len),
        params,
    )


class OutputLog:
    """One engine request's generations, from its DELTA outputs: each piece as it comes
    (``deltas``) and every completion whole when the request finishes."""

    def __init__(self, request_id: str, deltas: bool, max_len: int) -> None:
        self.request_id = request_id
        self.deltas = deltas
        self.max_len = max_len
        self.texts: dict[int, list[str]] = {}
        self.token_ids: dict[int, list[int]] = {}

    def add(self, output: RequestOutput) -> None:
        for completion in output.outputs:
            self.texts.setdefault(completion.index, []).append(completion.text)
            self.token_ids.setdefault(completion.index, []).extend(completion.token_ids)
            if self.deltas and not output.finished:
                logger.info(
                    "Generated response %s (streaming delta): output %s, output_token_ids %s",
                    self._name(completion.index),
                    shown(completion.text, self.max_len),
                    completion.token_ids,
                )
        if not output.finished:
            return
        reasons = {c.index: c.finish_reason for c in output.outputs}
        for index in sorted(self.texts):
            logger.info(
                "Generated response %s: output %s, output_token_ids %s, finish_reason %s",
                self._name(index),
                shown("".join(self.texts[index]), self.max_len),
                shown(self.token_ids[index], self.max_len),
                reasons.get(index),
            )

    def _name(self, index: int) -> str:
        return (
            self.request_id
            if index == 0 and len(self.texts) == 1
            else f"{self.request_id}[{index}]"
        )
