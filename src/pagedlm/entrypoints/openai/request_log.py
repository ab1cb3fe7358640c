"""The server's per-request log lines (vLLM's flags): ``--enable-log-requests`` logs what
each engine request received, ``--enable-log-outputs`` what it generated (with
``--enable-log-deltas``, each streamed piece too). Logged text is cut to ``--max-log-len``
characters."""

from __future__ import annotations

import logging
from typing import Any

from pagedlm.outputs import RequestOutput

logger = logging.getLogger("pagedlm.server")


def cut(text: str, max_len: int) -> str:
    return text if len(text) <= max_len else text[:max_len] + "..."


def log_received(request_id: str, prompt: Any, params: Any, max_len: int) -> None:
    logger.info(
        "Received request %s: prompt %s, params %s", request_id, cut(repr(prompt), max_len), params
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
