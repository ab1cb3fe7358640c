"""Pipeline parallelism: which layers a stage holds, and what stages send each other.

Per step, stage ``s`` receives the previous stage's intermediate tensors (each
``[num_tokens, hidden_size]`` in the model's dtype, named by the model: Llama sends its
hidden states and residual stream), runs its layers and sends its own to stage ``s + 1``;
the last stage computes logits and samples; the sampled ids reach the other stages through
the scheduler's next step (``CachedRequestData.new_token_ids``), so no stage waits for a
later one. Both sides know every shape from the step itself, so only tensor data crosses.
"""

from __future__ import annotations

import torch

from pagedlm.distributed.parallel_state import get_pipeline_state

IntermediateTensors = dict[str, torch.Tensor]
"""What one stage hands the next: name -> ``[num_tokens, hidden_size]``."""


def stage_layer_range(num_layers: int, stage: int, num_stages: int) -> tuple[int, int]:
    """Layers ``[start, end)`` of pipeline stage ``stage``.

    Layers split evenly; the remainder goes to the stages just before the last one,
    because the last stage also computes the LM head (vLLM's partition).
    """
    if not 0 <= stage < num_stages or num_stages > num_layers:
        raise ValueError(
            f"cannot place stage {stage} of {num_stages} over {num_layers} layers; use at "
            "most one pipeline stage per layer."
        )
    sizes = [num_layers // num_stages] * num_stages
    for i in range(num_layers % num_stages):
        sizes[-2 - i] += 1  # a remainder exists only with two stages or more
    start = sum(sizes[:stage])
    return start, start + sizes[stage]


def this_stage_layers(num_layers: int) -> tuple[int, int]:
    """Layers ``[start, end)`` this process holds."""
    pp = get_pipeline_state()
    return stage_layer_range(num_layers, pp.rank, pp.world_size)


def send_intermediate(tensors: IntermediateTensors) -> None:
    """Send this stage's outputs to the next stage (in name order)."""
    import torch.distributed as dist

    pp = get_pipeline_state()
    destination = pp.ranks[pp.rank + 1]
    for name in sorted(tensors):
        dist.send(tensors[name].contiguous(), dst=destination, group=pp.group)


def recv_intermediate(
    names: tuple[str, ...],
    num_tokens: int,
    hidden_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> IntermediateTensors:
    """Receive the previous stage's outputs for a step of ``num_tokens`` tokens."""
    import torch.distributed as dist

    pp = get_pipeline_state()
    source = pp.ranks[pp.rank - 1]
    received: IntermediateTensors = {}
    for name in sorted(names):
        buffer = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
        dist.recv(buffer, src=source, group=pp.group)
        received[name] = buffer
    return received
