"""A multi-step decode window in flight: the handle ``ModelRunner.launch`` returns for it.

The runner queues the window's steps and then, right behind its last step, the copy of
every sampled token to pinned host memory, so that reading this window never waits for
a window queued after it (the engine core queues the next window before reading this one).
"""

from __future__ import annotations

import torch

from pagedlm.core.outputs import ModelRunnerOutput
from pagedlm.worker.request_state import CachedRequestState


def copy_to_host(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Event | None]:
    """Start copying ``tokens`` to (pinned) host memory; returns the host tensor and the
    event that marks the copy done (None when ``tokens`` already is on the host)."""
    if tokens.device.type == "cpu":
        return tokens, None
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    done = torch.Event(device=tokens.device)
    done.record()
    return host, done


class DecodeWindow:
    """``result()`` waits for the window's tokens once and appends them to the request
    states; windows are collected in launch order."""

    def __init__(
        self,
        req_ids: list[str],
        states: list[CachedRequestState],
        tokens: torch.Tensor,
        copied: torch.Event | None,
    ) -> None:
        self.req_ids = req_ids
        self.states = states
        self.tokens = tokens
        """[num_steps, num_reqs] sampled ids on the host, valid once ``copied`` is done."""
        self.copied = copied

    def result(self) -> ModelRunnerOutput:
        if self.copied is not None:
            self.copied.synchronize()  # the one wait for the device
        per_step = self.tokens.tolist()
        sampled = [list(tokens) for tokens in zip(*per_step)]
        for state, tokens in zip(self.states, sampled):
            state.token_ids.extend(tokens)
        return ModelRunnerOutput(req_ids=self.req_ids, sampled_token_ids=sampled)
