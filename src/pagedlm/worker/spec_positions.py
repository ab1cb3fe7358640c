"""Where a step's tokens really start when the in-flight step's rejections are on the device.

Under asynchronous scheduling the scheduler plans step N+1 before step N's verification is
collected, counting all of step N's drafts as accepted (``num_drafts_in_flight``). Step N
wrote how many it rejected into a per-slot device tensor; the requests of step N+1 that
it verified start that many positions earlier. ``StepInputBuilder`` resolves that either on
the host (``needs_exact_lengths`` or a backend that plans from host lengths: it waits for
step N) or here, on the device, without waiting: positions, sequence lengths and every
gather index derived from a position move back by the request's rejections.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from pagedlm.worker.input_batch import RequestState


def needs_exact_lengths(
    states: Sequence[RequestState],
    starts: np.ndarray,
    in_flight: np.ndarray,
    counts: dict[str, int],
) -> bool:
    """Whether sampling reads the exact length of a request whose start is uncertain:
    penalties read its tokens so far, and ``min_tokens`` masks its stop tokens until it has
    enough outputs (which up to ``counts`` rejected drafts leave in doubt)."""
    for state, start, uncertain in zip(states, starts, in_flight, strict=True):
        if not uncertain:
            continue
        if state.needs_token_history:
            return True
        min_tokens = state.sampling_params.min_tokens
        fewest_outputs = int(start) + 1 - counts[state.req_id] - state.num_prompt_tokens
        if min_tokens and fewest_outputs < min_tokens:
            return True
    return False


InFlightCorrector = Callable[..., None]
"""A kernel doing what ``correct_on_device`` does, called with the same arguments; a
platform may provide one (``Platform.in_flight_corrector``)."""


def correct_on_device(
    token_index: torch.Tensor,
    block_index: torch.Tensor,
    block_offset: torch.Tensor,
    sample_index: torch.Tensor,
    slots: torch.Tensor,
    in_flight: torch.Tensor,
    sampled: torch.Tensor,
    seq_lens: torch.Tensor,
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_rejected: torch.Tensor,
    row_length: int,
    blocks_per_row: int,
    block_size: int,
) -> None:
    """Move every in-flight request's positions back by its rejections, in place.

    Device int32 views of the step's staged buffers: ``token_index``/``block_index``/
    ``block_offset`` ``[>= num_tokens]`` (flat token-table index, flat block-table index,
    offset in block per token), ``sample_index`` ``[num_sampled]``, ``slots``/``in_flight``
    ``[num_reqs]`` (0/1), ``sampled`` ``[num_sampled]`` request indices, ``seq_lens``
    ``[num_reqs]``, ``positions`` ``[num_tokens]``, ``query_start_loc`` ``[num_reqs + 1]``;
    ``num_rejected`` ``[max_num_reqs]`` by slot.
    """
    num_tokens = positions.shape[0]
    shift = num_rejected[slots.long()] * in_flight
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    token_shift = torch.repeat_interleave(shift, query_lens, output_size=num_tokens)
    positions.sub_(token_shift)
    seq_lens.sub_(shift)
    tokens = token_index[:num_tokens]
    tokens.sub_(token_shift)
    row_start = tokens - positions  # slot * row_length
    block_index[:num_tokens] = row_start // row_length * blocks_per_row + positions // block_size
    block_offset[:num_tokens] = positions % block_size
    sample_index.sub_(shift[sampled.long()])
