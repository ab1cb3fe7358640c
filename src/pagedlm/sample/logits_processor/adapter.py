"""Per-request logits processors (callables on one row) behind the batch interface."""

from __future__ import annotations

import inspect
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
        self._rows: dict[int, _Bound] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        """The callable for a request with ``params``, or None."""

    def _bind(
        self, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]
    ) -> _Bound | None:
        function = self.new_req_logits_processor(params)
        if function is None:
            return None
        return _Bound(function, _takes_prompt(function), prompt_ids, output_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._rows, batch_update, self._bind)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, bound in self._rows.items():
            row = logits[index]
            processed = bound(row)
            if processed is not row:
                logits[index] = processed
        return logits
