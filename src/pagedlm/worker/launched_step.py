"""A step whose sampling is queued on the device: the handle ``sample_tokens`` returns.

Right after the step's last kernel the runner queues the copy of its sampled ids (and
logprobs) to pinned host memory, with an event; ``result()`` waits for that event only, so
collecting step N never waits for step N+1, which asynchronous scheduling queues first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedlm.sample.logprobs import LogprobsTensors
from pagedlm.step import LogprobsLists, ModelRunnerOutput
from pagedlm.worker.prompt_logprobs import PromptLogprobRows

if TYPE_CHECKING:
    from pagedlm.worker.speculative import Proposals


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


@dataclass(frozen=True)
class Verified:
    """A verification's device results: request ``i`` of the sampled ones emitted
    ``token_ids[i, :num_emitted[i]]``; it had ``num_rows[i]`` logprobs rows."""

    num_emitted: torch.Tensor
    num_rows: list[int]


class LaunchedStep:
    """``result()`` waits for the step's copies once and builds its ``ModelRunnerOutput``.

    ``sampled[i]`` is the index in ``req_ids`` of the request that sampled row ``i`` of
    ``token_ids`` (``[n]``, or ``[n, W]`` with ``verified``); ``logprobs`` (one row per
    logits row) and ``prompt_logprobs`` are trimmed per request. ``proposals``: drafts for
    the next step, reported as ``draft_token_ids``. ``failed``: requests a callable of
    their own failed (known when the step was sampled), reported as they are.
    """

    def __init__(
        self,
        req_ids: list[str],
        sampled: list[int],
        token_ids: torch.Tensor,
        logprobs: LogprobsTensors | None,
        num_logprobs: list[int | None] | None,
        prompt_logprobs: LogprobsTensors | None,
        prompt_parts: list[PromptLogprobRows],
        verified: Verified | None = None,
        proposals: Proposals | None = None,
        failed: dict[str, str] | None = None,
    ) -> None:
        self.req_ids = req_ids
        self.failed = failed or {}
        self.sampled = sampled
        self.num_logprobs = num_logprobs
        self.prompt_parts = prompt_parts
        self.num_rows = None if verified is None else verified.num_rows
        self.draft_owners = None if proposals is None else proposals.req_index
        tensors = [token_ids.reshape(len(sampled), -1) if sampled else token_ids.reshape(0, 1)]
        for group in (logprobs, prompt_logprobs):
            if group is not None:
                tensors.extend(group)
        if verified is not None:
            tensors.append(verified.num_emitted)
        if proposals is not None:
            tensors.extend([proposals.drafts, proposals.num_valid])
        self._host, self._copied = copy_to_host(tensors)
        self._has_logprobs = logprobs is not None
        self._has_prompt_logprobs = prompt_logprobs is not None

    def first_sampled_ids(self) -> list[int]:
        """Each sampled row's first token id, after waiting for the copy to the host."""
        if self._copied is not None:
            self._copied.synchronize()
        return self._host[0][:, 0].tolist()

    def result(self) -> ModelRunnerOutput:
        if self._copied is not None:
            self._copied.synchronize()  # the one wait for the device
        host = iter(self._host)
        token_ids = next(host).tolist()
        logprob_rows = None
        if self._has_logprobs:
            logprob_rows = LogprobsTensors(next(host), next(host), next(host))
        prompt_rows = None
        if self._has_prompt_logprobs:
            prompt_rows = LogprobsTensors(next(host), next(host), next(host))
        num_emitted = [1] * len(self.sampled)
        if self.num_rows is not None:
            num_emitted = next(host).tolist()
        sampled: list[list[int]] = [[] for _ in self.req_ids]
        for index, tokens, count in zip(self.sampled, token_ids, num_emitted, strict=True):
            sampled[index] = tokens[:count]
        logprobs: dict[str, LogprobsLists] = {}
        if logprob_rows is not None:
            logprobs = self._logprobs(logprob_rows, num_emitted)
        draft_token_ids: dict[str, list[int]] = {}
        if self.draft_owners is not None:
            drafts, num_valid = next(host).tolist(), next(host).tolist()
            for index, row, count in zip(self.draft_owners, drafts, num_valid, strict=True):
                draft_token_ids[self.req_ids[index]] = row[:count]
        prompt_logprobs: dict[str, LogprobsLists] = {}
        if prompt_rows is not None:
            rows = prompt_rows
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
            draft_token_ids=draft_token_ids,
            failed=self.failed,
        )

    def _logprobs(self, rows: LogprobsTensors, num_emitted: list[int]) -> dict[str, LogprobsLists]:
        """Per request with logprobs, the rows of the tokens it emitted."""
        logprobs: dict[str, LogprobsLists] = {}
        if self.num_rows is None:  # one row each: one host conversion for all
            counts = [n or 0 for n in self.num_logprobs]
            for index, lists, count in zip(self.sampled, rows.to_lists(counts), self.num_logprobs):
                if count is not None:
                    logprobs[self.req_ids[index]] = lists
            return logprobs
        num_rows = self.num_rows
        offset = 0
        for index, count, rows_of, emitted in zip(
            self.sampled, self.num_logprobs, num_rows, num_emitted, strict=True
        ):
            if count is not None:
                part = LogprobsTensors(
                    rows.token_ids[offset : offset + emitted],
                    rows.logprobs[offset : offset + emitted],
                    rows.ranks[offset : offset + emitted],
                )
                logprobs[self.req_ids[index]] = part.to_position_lists(count)
            offset += rows_of
        return logprobs
