"""The worker's side of prompts given as embeddings (``enable_prompt_embeds``).

Per step, in ``execute_model`` order: ``update`` takes the rows of newly admitted (or
resumed) requests to the device and drops those of finished and preempted ones; a step
that ``feeds`` any prompt position of such a request runs eagerly, from embeddings: the
step's ids are embedded (``model.embed_input_ids``, placeholders included) and ``write``
puts the request's rows over its placeholders' rows. A request's rows are dropped once its
prompt has been fed; a preempted request gets them again with its next admission.

``NullPromptEmbeds`` stands in when the engine takes no embeddings (every step is ids).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from pagedlm.attention import BatchLayout
from pagedlm.config import EngineConfig
from pagedlm.multimodal.tensors import from_tensor_data
from pagedlm.step import SchedulerOutput


class NullPromptEmbeds:
    def update(self, scheduler_output: SchedulerOutput) -> None:
        pass

    def feeds(self, scheduler_output: SchedulerOutput) -> bool:
        return False

    def clear(self) -> None:
        pass


class PromptEmbeds:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rows: dict[str, torch.Tensor] = {}
        """req_id -> the prompt's rows [num_prompt_tokens, hidden] on the device, for the
        requests whose prompt is not fed whole yet."""

    def update(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
            self.rows.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            data = new.prompt_embeds
            if data is not None and new.num_computed_tokens < data.shape[0]:
                self.rows[new.req_id] = from_tensor_data(data, self.device)

    def _overlaps(self, scheduler_output: SchedulerOutput) -> Iterator[tuple[int, int, int, str]]:
        """(batch row, first, end, req_id): the prompt rows ``[first, end)`` a request of
        the step feeds, ``first`` being where its scheduled tokens start."""
        scheduled = scheduler_output.num_scheduled_tokens
        for row, (req_id, start) in enumerate(
            zip(scheduler_output.req_ids, scheduler_output.num_computed_tokens, strict=True)
        ):
            rows = self.rows.get(req_id)
            if rows is not None and start < rows.shape[0]:
                yield row, start, min(start + scheduled[req_id], rows.shape[0]), req_id

    def feeds(self, scheduler_output: SchedulerOutput) -> bool:
        return bool(self.rows) and any(True for _ in self._overlaps(scheduler_output))

    def clear(self) -> None:
        """Drop every request's rows (sleep mode: no request is unfinished)."""
        self.rows.clear()

    def write(
        self, embeds: torch.Tensor, scheduler_output: SchedulerOutput, layout: BatchLayout
    ) -> None:
        """Overwrite ``embeds`` [num_tokens, hidden] (the step's ids embedded) at every
        prompt position the step feeds; forget the prompts fed to their end."""
        query_start = layout.query_start_loc_cpu
        done = []
        for row, start, end, req_id in list(self._overlaps(scheduler_output)):
            at = int(query_start[row])
            rows = self.rows[req_id]
            embeds[at : at + end - start] = rows[start:end].to(embeds.dtype)
            if end == rows.shape[0]:
                done.append(req_id)
        for req_id in done:
            del self.rows[req_id]


def make_prompt_embeds(
    config: EngineConfig, model: nn.Module, device: torch.device
) -> PromptEmbeds | NullPromptEmbeds:
    """The runner's component; refuses, at start-up, a model that cannot take embeddings."""
    if not config.model.enable_prompt_embeds:
        return NullPromptEmbeds()
    if not getattr(model, "supports_prompt_embeds", False):
        raise ValueError(
            f"enable_prompt_embeds=True, but {type(model).__name__} "
            f"({config.model.arch.architecture}) cannot take prompts as embeddings; the "
            "Llama-family models and the Transformers backend can. Drop "
            "--enable-prompt-embeds."
        )
    return PromptEmbeds(device)
