"""One pipeline stage's forward: receive from the stage before, run, send to the next.

Without pipeline parallelism this is the model's forward and nothing else.
"""

from __future__ import annotations

import torch

from pagedlm.distributed.parallel_state import get_pipeline_state
from pagedlm.distributed.pipeline import recv_intermediate, send_intermediate
from pagedlm.model_executor.forward_context import ForwardContext


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
