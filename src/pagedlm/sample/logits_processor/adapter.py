"""Per-request logits processors (callables on one row) behind the batch interface.

A request's callable that raises (or returns no tensor of its row's shape), or a
``new_req_logits_processor`` that raises for its parameters, fails that request alone: its
row is left as it was, it is not called again, and the failure is reported through
``take_failed_rows`` (the engine then ends the request with finish reason "error").
"""

from __future__ import annotations

import inspect
import logging
from abc import abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from pagedlm.sample.logits_processor.interface import (
    BatchUpdate,
    LogitsProcessor,
    process_dict_updates,
)
from pagedlm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedlm.config import EngineConfig

logger = logging.getLogger(__name__)

RequestLogitsProcessor = (
    Callable[[list[int], torch.Tensor], torch.Tensor]
    | Callable[[list[int], list[int], torch.Tensor], torch.Tensor]
)
"""``(output_token_ids, logits_row) -> logits_row`` or, with three parameters,
``(prompt_token_ids, output_token_ids, logits_row) -> logits_row``; ``logits_row`` is
``[vocab]`` float32 and may be written in place."""


class _Bound(NamedTuple):
    function: Callable[..., torch.Tensor]
    takes_prompt: bool
    prompt_token_ids: list[int] | None
    output_token_ids: list[int]

    def __call__(self, row: torch.Tensor) -> torch.Tensor:
        if self.takes_prompt:
            return self.function(self.prompt_token_ids, self.output_token_ids, row)
        return self.function(self.output_token_ids, row)


class _Failed(NamedTuple):
    """A request whose callable failed (or could not be made): its message."""

    message: str


def failure_message(processor: object, exc: BaseException) -> str:
    """How a processor's exception is reported to the request it failed."""
    return f"logits processor {type(processor).__qualname__} raised {type(exc).__name__}: {exc}"


def _takes_prompt(function: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: the two-argument form
        return False
    positional = [
        p
        for p in parameters
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    if len(positional) not in (2, 3):
        raise ValueError(
            f"a request logits processor takes (output_token_ids, logits) or "
            f"(prompt_token_ids, output_token_ids, logits); {function!r} takes "
            f"{len(positional)} positional parameters."
        )
    return len(positional) == 3


class AdapterLogitsProcessor(LogitsProcessor):
    """Subclass it, implement ``new_req_logits_processor`` (a request's callable, or None
    to leave the request alone) and ``is_argmax_invariant``; the batch bookkeeping is
    done here. Rows are processed one by one, so prefer a batch ``LogitsProcessor`` where
    many requests use it."""

    def __init__(self, config: EngineConfig, device: torch.device, is_pin_memory: bool) -> None:
        self._rows: dict[int, _Bound | _Failed] = {}
        self._failed_rows: dict[int, str] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        """The callable for a request with ``params``, or None."""

    def _bind(
        self, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]
    ) -> _Bound | _Failed | None:
        try:
            function = self.new_req_logits_processor(params)
            if function is None:
                return None
            return _Bound(function, _takes_prompt(function), prompt_ids, output_ids)
        except Exception as exc:
            return self._failed(exc)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._rows, batch_update, self._bind)
        self._failed_rows = {
            index: bound.message
            for index, bound in self._rows.items()
            if isinstance(bound, _Failed)
        }

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, bound in self._rows.items():
            if isinstance(bound, _Failed):
                continue
            row = logits[index]
            try:
                processed = bound(row)
                if processed is not row:
                    logits[index] = processed
            except Exception as exc:
                failed = self._rows[index] = self._failed(exc)
                self._failed_rows[index] = failed.message
        return logits

    def take_failed_rows(self) -> dict[int, str]:
        """Batch index -> message of each request whose callable failed (since the last
        ``update_state``); each such request stays failed until it leaves the batch."""
        return dict(self._failed_rows)

    def _failed(self, exc: Exception) -> _Failed:
        logger.warning("a request's logits processor failed", exc_info=exc)
        return _Failed(failure_message(self, exc))
