"""Per-step sampling inputs: one :class:`SamplingRow` per request, turned into batch tensors.

:meth:`SamplingMetadata.build` runs once per step on the host. It decides which stages the
batch needs (a stage no row uses gets ``None`` and is skipped by the sampler) and gives
greedy rows neutral filter values so that they never trigger a stage on their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedlm.sample.host_copy import to_device
from pagedlm.sample.logit_bias import LogitAdjustments
from pagedlm.sample.logits_processor.batch import CustomLogitsProcessors
from pagedlm.sample.penalties import PenaltyTensors, TokenHistory
from pagedlm.sample.row import SamplingRow, is_greedy
from pagedlm.sample.topk_topp import FilterTensors


@dataclass(frozen=True)
class SamplingMetadata:
    """Tensors for a batch of ``N`` rows, in the order of the logits rows.

    ``temperature``: ``[N]`` float32 (greedy rows hold 1.0), ``None`` when no random row
    needs scaling (all greedy, or every temperature is 1).
    ``greedy_mask``: ``[N]`` bool, only for a batch mixing greedy and random rows.
    ``seeded_rows``: ``(row, generator)`` for random rows with their own generator.
    ``has_unseeded_random_rows``: some random row draws from ``default_generator``
    (``None`` = torch's default generator of the device).
    ``max_num_logprobs``: the largest ``params.logprobs`` of the batch, ``None`` if no row asks.
    ``logits_processors``: the engine's custom processors, told this batch's rows already
    (``CustomLogitsProcessors.update``); None when the engine has none.
    """

    num_rows: int
    vocab_size: int
    device: torch.device
    all_greedy: bool
    all_random: bool
    greedy_mask: torch.Tensor | None
    temperature: torch.Tensor | None
    filters: FilterTensors
    penalties: PenaltyTensors | None
    logit_adjustments: LogitAdjustments | None
    seeded_rows: tuple[tuple[int, torch.Generator], ...]
    has_unseeded_random_rows: bool
    default_generator: torch.Generator | None
    max_num_logprobs: int | None
    logits_processors: CustomLogitsProcessors | None = None

    @classmethod
    def build(
        cls,
        rows: list[SamplingRow],
        vocab_size: int,
        device: torch.device,
        default_generator: torch.Generator | None = None,
        token_history: TokenHistory | None = None,
        logits_processors: CustomLogitsProcessors | None = None,
    ) -> SamplingMetadata:
        """Build the batch tensors for ``rows`` (one per logits row, same order);
        ``token_history`` gives the penalized rows' tokens (needed only if any row has a
        penalty)."""
        if not rows:
            raise ValueError("SamplingMetadata.build needs at least one row to sample.")
        device = torch.device(device)
        greedy = [is_greedy(row.params) for row in rows]
        all_greedy = all(greedy)
        all_random = not any(greedy)
        # Greedy rows get neutral values: they ride through the random path unfiltered.
        random_params = [None if g else row.params for g, row in zip(greedy, rows, strict=True)]
        temperatures = [1.0 if p is None else p.temperature for p in random_params]
        needs_temperature = not all_greedy and any(t != 1.0 for t in temperatures)
        filters = FilterTensors.build(
            min_p=[0.0 if p is None else p.min_p for p in random_params],
            top_k=[-1 if p is None else p.top_k for p in random_params],
            top_p=[1.0 if p is None else p.top_p for p in random_params],
            vocab_size=vocab_size,
            device=device,
        )
        seeded_rows = tuple(
            (index, row.generator)
            for index, row in enumerate(rows)
            if random_params[index] is not None and row.generator is not None
        )
        logprob_counts = [row.params.logprobs for row in rows if row.params.logprobs is not None]
        return cls(
            num_rows=len(rows),
            vocab_size=vocab_size,
            device=device,
            all_greedy=all_greedy,
            all_random=all_random,
            greedy_mask=(
                None if all_greedy or all_random else to_device(greedy, torch.bool, device)
            ),
            temperature=(
                to_device(temperatures, torch.float32, device) if needs_temperature else None
            ),
            filters=filters,
            penalties=PenaltyTensors.build(rows, vocab_size, device, token_history),
            logit_adjustments=LogitAdjustments.build(rows, vocab_size, device, token_history),
            seeded_rows=seeded_rows,
            has_unseeded_random_rows=len(rows) - sum(greedy) > len(seeded_rows),
            default_generator=default_generator,
            max_num_logprobs=max(logprob_counts) if logprob_counts else None,
            logits_processors=logits_processors,
        )
