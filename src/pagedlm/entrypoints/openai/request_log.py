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
    shown = cut(repr(loggable_prompt(prompt)), max_len)
    logger.info("Received request %s: prompt %s, params %s", request_id, shown, params)


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
                    cut(repr(completion.text), self.max_len),
                    completion.token_ids,
                )
        if not output.finished:
            return
        reasons = {c.index: c.finish_reason for c in output.outputs}
        for index in sorted(self.texts):
            logger.info(
                "Generated response %s: output %s, output_token_ids %s, finish_reason %s",
                self._name(index),
                cut(repr("".join(self.texts[index])), self.max_len),
                cut(repr(self.token_ids[index]), self.max_len),
                reasons.get(index),
            )

    def _name(self, index: int) -> str:
        return (
            self.request_id
            if index == 0 and len(self.texts) == 1
            else f"{self.request_id}[{index}]"
        )
