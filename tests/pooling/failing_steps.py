"""Engine-core failures of pooling requests, injected where the scheduler reads a step's
outputs: a request whose prompt holds a given token id is reported failed by the step that
pools it, as a worker reports one whose LoRA adapter or logits processor failed (no pooling
request can meet either today). In a module of its own so that ``collective_rpc`` can send
``fail_prompts_with`` to the engine-core process by name (tests put ``tests/`` on its
``PYTHONPATH``); there the uniproc worker shares the scheduler's process."""

from __future__ import annotations

from dataclasses import replace

from pagedlm.core.scheduler import OneBudgetScheduler

_update_from_output = OneBudgetScheduler.update_from_output


def failing_update(token_id: int, message: str):
    """``OneBudgetScheduler.update_from_output`` that fails the step's requests whose
    prompt holds ``token_id`` with ``message``."""

    def update_from_output(self, scheduler_output, runner_output):
        failed = {
            req_id: message
            for req_id in runner_output.req_ids
            if req_id in self.requests and token_id in self.requests[req_id].prompt_token_ids
        }
        if failed:
            runner_output = replace(runner_output, failed={**runner_output.failed, **failed})
        return _update_from_output(self, scheduler_output, runner_output)

    return update_from_output


def fail_prompts_with(worker, token_id: int, message: str) -> bool:
    """``collective_rpc`` function: from now on, in the worker's (engine-core) process."""
    OneBudgetScheduler.update_from_output = failing_update(token_id, message)
    return True
