"""When a schedule may run several decode steps back to back (multi-step decoding).

With ``num_scheduler_steps`` = K > 1 (vLLM's name), the workers run up to K decode steps per
``SchedulerOutput``, each fed the tokens the previous one sampled, without a round trip
through the host: the host's per-step work (stops, outputs, scheduling) is paid once per K
tokens. That is only allowed when it cannot change what is generated:

- every running request is decoding (exactly one token to feed), since a prefill chunk
  would need the host to know the sampled token before the next chunk;
- nothing waiting could start now (no free sequence slot, or nothing waiting): a new
  request must not wait K steps for a slot it could have had;
- no request needs host work between its tokens: penalties and the ``min_tokens`` stop
  mask read the tokens so far, logprobs are returned per token, and a grammar advances
  per token.

Stops are applied afterwards by the scheduler, token by token, so a request that stops
early wastes at most K - 1 forward rows.

Chained windows (``plan_continuation``): the next window may be scheduled while the
current one still runs, before the host has seen its tokens, so the device never waits
for the host between windows. That assumes no request stops inside the current window
except by length (known in advance: such requests are left out); one that does stop on a
token runs through the next window too, and the scheduler drops those tokens. It is only
done while nothing waits at all, so a new request is never held back by the chain.
"""

from __future__ import annotations

from collections.abc import Collection

from pagedlm.config import SchedulerConfig
from pagedlm.core.request import Request


def _needs_host_between_tokens(request: Request) -> bool:
    params = request.sampling_params
    return (
        params.logprobs is not None
        or params.structured_outputs is not None
        or request.num_output_tokens < params.min_tokens
        or params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    )


def plan_num_steps(
    config: SchedulerConfig, running: list[Request], waiting: Collection[Request]
) -> int:
    """Decode steps the next schedule may run: 1 unless everything above holds; then at most
    ``num_scheduler_steps``, no more than the longest remaining ``max_tokens`` of the batch
    (others drop their extra tokens), and short enough that no request feeds a position at
    or past ``max_model_len``."""
    max_steps = config.num_scheduler_steps
    if max_steps <= 1 or not running:
        return 1
    if waiting and len(running) < config.max_num_seqs:
        return 1
    if len(running) > config.max_num_batched_tokens:
        return 1
    most_remaining = 1
    for request in running:
        num_tokens = request.num_tokens
        if num_tokens - request.num_computed_tokens != 1 or _needs_host_between_tokens(request):
            return 1
        # Step k feeds position num_tokens - 1 + k, which must stay below max_model_len.
        max_steps = min(max_steps, config.max_model_len - num_tokens + 1)
        most_remaining = max(most_remaining, request.max_tokens - request.num_output_tokens)
    return max(1, min(max_steps, most_remaining))


def plan_continuation(
    config: SchedulerConfig,
    window: list[Request],
    in_flight: int,
    waiting: Collection[Request],
) -> tuple[list[Request], int]:
    """Which of ``window``'s requests (all decoding, ``in_flight`` tokens each still on
    the device) the next window feeds, and how many steps it runs; ``([], 0)`` when it
    must wait for the host instead. Same limits as ``plan_num_steps``, counted as if
    every in-flight token had been appended."""
    if config.num_scheduler_steps <= 1 or waiting:
        return [], 0
    max_steps = config.num_scheduler_steps
    most_remaining = 0
    continuing = []
    for request in window:
        if _needs_host_between_tokens(request):
            return [], 0
        num_tokens = request.num_tokens + in_flight
        num_output = request.num_output_tokens + in_flight
        if num_output >= request.max_tokens or num_tokens >= config.max_model_len:
            continue  # finishes by length within the window in flight
        max_steps = min(max_steps, config.max_model_len - num_tokens + 1)
        most_remaining = max(most_remaining, request.max_tokens - num_output)
        continuing.append(request)
    num_steps = min(max_steps, most_remaining)
    if not continuing or num_steps < 2:
        return [], 0  # one step left is as cheap through the host
    return continuing, num_steps
