"""One pipeline stage's forward: receive from the stage before, run, send to the next.

Without pipeline parallelism this is the model's forward and nothing else.

The stages exchange nothing else: the ids the last stage samples reach the other stages'
token tables through the scheduler (``CachedRequestData.new_token_ids``, written by
``write_new_token_ids``), so a stage never waits for a later one and several steps can be
in flight at once, one per stage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedlm.distributed.parallel_state import get_pipeline_state
from pagedlm.distributed.pipeline import recv_intermediate, send_intermediate
from pagedlm.model_executor.forward_context import ForwardContext

if TYPE_CHECKING:
    from pagedlm.step import SchedulerOutput
    from pagedlm.worker.input_batch import InputBatch


def run_stage(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    ctx: ForwardContext,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """Hidden states ``[num_tokens, hidden_size]`` on the last stage; None on the others
    (they have sent their intermediate tensors on)."""
    pp = get_pipeline_state()
    if pp.world_size == 1:
        return model(input_ids, positions, ctx)
    intermediate = None
    if not pp.is_first:
        intermediate = recv_intermediate(
            model.intermediate_names,
            input_ids.shape[0],
            model.arch.hidden_size,
            dtype,
            input_ids.device,
        )
    out = model(input_ids, positions, ctx, intermediate)
    if pp.is_last:
        return out
    send_intermediate(out)
    return None


def write_new_token_ids(batch: InputBatch, scheduler_output: SchedulerOutput) -> None:
    """Write the output tokens the scheduler hands on (pipeline parallelism) into the
    requests' rows of the token table; they end the tokens this step feeds. On the last
    stage they overwrite the ids it sampled itself with the same values."""
    cached = scheduler_output.scheduled_cached_reqs
    if not cached.new_token_ids:
        return
    scheduled = scheduler_output.num_scheduled_tokens
    index: list[int] = []
    values: list[int] = []
    for req_id, computed, tokens in zip(
        cached.req_ids, cached.num_computed_tokens, cached.new_token_ids, strict=True
    ):
        if tokens:
            row = batch.requests[req_id].slot * batch.row_length
            start = computed + scheduled[req_id] - len(tokens)
            index.extend(range(row + start, row + start + len(tokens)))
            values.extend(tokens)
    if index:
        device = batch.token_ids.device
        batch.token_ids.view(-1).index_put_(
            (torch.tensor(index, dtype=torch.int64, device=device),),
            torch.tensor(values, dtype=batch.token_ids.dtype, device=device),
        )
