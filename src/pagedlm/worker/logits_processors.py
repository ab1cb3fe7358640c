"""A worker's custom logits processors, and the host token lists they read.

A worker otherwise keeps a request's tokens only on the device (``InputBatch.token_ids``).
Processors are promised each request's prompt and its outputs so far as Python lists,
extended in place. The lists start from what admission carries (prompt and, for a resumed
request, its outputs) and grow from each step's sampled ids: a step's ids are appended
when the next step is sampled, after waiting for that earlier step's copy to the host.
Under asynchronous scheduling the engine has already collected that step by then, so the
wait costs nothing; the device never waits for the host.

Invariant: when ``before_sampling`` tells the processors a batch, every request's output
list holds every token sampled for it by the steps launched before the one being sampled.

A processor that raises fails requests, never the step (``sample.logits_processor.batch``):
``failures`` names them after the sampling, and the step reports them
(``ModelRunnerOutput.failed``) for the scheduler to end with finish reason "error".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedlm.sample.logits_processor import BatchRequest, CustomLogitsProcessors
from pagedlm.sample.logits_processor.loading import resolve
from pagedlm.step import SchedulerOutput
from pagedlm.worker.input_batch import RequestState
from pagedlm.worker.launched_step import LaunchedStep

if TYPE_CHECKING:
    from pagedlm.config import EngineConfig


def make_logits_processors(
    config: EngineConfig, device: torch.device, is_pin_memory: bool
) -> WorkerLogitsProcessors | None:
    """The engine's custom processors, built on this worker (None: it has none)."""
    if not config.logits_processors:
        return None
    classes = [resolve(spec) for spec in config.logits_processors]
    return WorkerLogitsProcessors(
        CustomLogitsProcessors([cls(config, device, is_pin_memory) for cls in classes])
    )


class WorkerLogitsProcessors:
    """Calls: ``admit`` every step, before its forward; ``before_sampling`` with the rows
    about to be sampled; ``failures`` and ``launched`` once they are sampled."""

    def __init__(self, processors: CustomLogitsProcessors) -> None:
        self.processors = processors
        self._prompts: dict[str, list[int]] = {}
        self._outputs: dict[str, list[int]] = {}
        self._pending: list[tuple[LaunchedStep, list[tuple[str, int]]]] = []
        """Launched steps whose ids are not in the lists yet, with (request, output
        index) per sampled row."""

    def admit(self, scheduler_output: SchedulerOutput) -> None:
        """Follow the step's finished, new and resumed requests (before it runs)."""
        for req_id in scheduler_output.finished_req_ids:
            self._prompts.pop(req_id, None)
            self._outputs.pop(req_id, None)
        for data in scheduler_output.scheduled_new_reqs:
            outputs = data.token_ids[data.num_prompt_tokens :]
            if data.req_id in self._outputs:  # resumed: the same lists, made current
                self._outputs[data.req_id][:] = outputs
            else:
                self._prompts[data.req_id] = list(data.token_ids[: data.num_prompt_tokens])
                self._outputs[data.req_id] = list(outputs)

    def before_sampling(self, states: Sequence[RequestState]) -> CustomLogitsProcessors:
        """Tell the processors the batch ``states`` (one per logits row) and return them."""
        self._catch_up()
        self.processors.update(
            [
                BatchRequest(
                    state.serial,
                    state.sampling_params,
                    self._prompts[state.req_id],
                    self._outputs[state.req_id],
                )
                for state in states
            ]
        )
        return self.processors

    def failures(self, states: Sequence[RequestState]) -> dict[str, str]:
        """Request id -> message of each request a processor failed in the step just
        sampled, whose rows were ``states`` (those given to ``before_sampling``)."""
        failed = self.processors.take_failures()
        return {states[index].req_id: message for index, message in failed.items()}

    def _catch_up(self) -> None:
        """Append the ids of the launched steps not yet taken in (see the invariant)."""
        for step, rows in self._pending:
            for (req_id, index), token in zip(rows, step.first_sampled_ids(), strict=True):
                outputs = self._outputs.get(req_id)
                if outputs is None:
                    continue  # finished since
                if index == len(outputs):
                    outputs.append(token)
                elif index < len(outputs):
                    outputs[index] = token  # already known (resumed with it): the same id
        self._pending.clear()

    def launched(
        self, step: LaunchedStep, states: Sequence[RequestState], seq_lens: np.ndarray
    ) -> None:
        """Remember ``step``'s sampled rows: ``states[i]`` sampled its token number
        ``seq_lens[i]`` (counting the prompt's)."""
        rows = [
            (state.req_id, int(n) - state.num_prompt_tokens)
            for state, n in zip(states, seq_lens, strict=True)
        ]
        self._pending.append((step, rows))
