"""A step whose sampling is queued on the device: the handle ``sample_tokens`` returns.

Right after the step's last kernel the runner queues the copy of its sampled ids (and
logprobs) to pinned host memory, with an event; ``result()`` waits for that event only, so
collecting step N never waits for step N+1, which asynchronous scheduling queues first.
"""

from __future__ import annotations

import torch

from pagedlm.sample.logprobs import LogprobsTensors
from pagedlm.step import LogprobsLists, ModelRunnerOutput
from pagedlm.worker.prompt_logprobs import PromptLogprobRows


def copy_to_host(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Event | None]:
    """Start copying ``tensors`` to (pinned) host memory; returns the host tensors and the
    event that marks the copies done (None when they already are on the host)."""
    if all(t.device.type == "cpu" for t in tensors):
        return tensors, None
    hosts = []
    for tensor in tensors:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        hosts.append(host)
    done = torch.Event(device=tensors[0].device)
    done.record()
    return hosts, done


class LaunchedStep:
    """``result()`` waits for the step's copies once and builds its ``ModelRunnerOutput``.

    ``sampled[i]`` is the index in ``req_ids`` of the request that sampled
    ``token_ids[i]``; ``logprobs`` and ``prompt_logprobs`` are trimmed per request.
    """

    def __init__(
        self,
        req_ids: list[str],
        sampled: list[int],
        token_ids: torch.Tensor,
        logprobs: LogprobsTensors | None,
        num_logprobs: list[int | None],
        prompt_logprobs: LogprobsTensors | None,
        prompt_parts: list[PromptLogprobRows],
    ) -> None:
        self.req_ids = req_ids
        self.sampled = sampled
        self.num_logprobs = num_logprobs
        self.prompt_parts = prompt_parts
        tensors = [token_ids]
        for group in (logprobs, prompt_logprobs):
            if group is not None:
                tensors.extend(group)
        self._host, self._copied = copy_to_host(tensors)
        self._has_logprobs = logprobs is not None
        self._has_prompt_logprobs = prompt_logprobs is not None

    def result(self) -> ModelRunnerOutput:
        if self._copied is not None:
            self._copied.synchronize()  # the one wait for the device
        host = iter(self._host)
        token_ids = next(host).tolist()
        sampled: list[list[int]] = [[] for _ in self.req_ids]
        for index, token_id in zip(self.sampled, token_ids, strict=True):
            sampled[index] = [token_id]
        logprobs: dict[str, LogprobsLists] = {}
        if self._has_logprobs:
            rows = LogprobsTensors(next(host), next(host), next(host))
            counts = [n or 0 for n in self.num_logprobs]
            for index, lists, count in zip(self.sampled, rows.to_lists(counts), self.num_logprobs):
                if count is not None:
                    logprobs[self.req_ids[index]] = lists
        prompt_logprobs: dict[str, LogprobsLists] = {}
        if self._has_prompt_logprobs:
            rows = LogprobsTensors(next(host), next(host), next(host))
            offset = 0
            for part in self.prompt_parts:
                end = offset + part.num_rows
                prompt_logprobs[part.req_id] = LogprobsTensors(
                    rows.token_ids[offset:end], rows.logprobs[offset:end], rows.ranks[offset:end]
                ).to_position_lists(part.num_logprobs)
                offset = end
        return ModelRunnerOutput(
            req_ids=self.req_ids,
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
