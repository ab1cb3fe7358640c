"""M-RoPE positions (Qwen2.5-VL): three per token (temporal, height, width), built by the
model runner for models with ``uses_mrope``.

A prompt's positions follow transformers' ``get_rope_index``: a text token's three parts
are equal and one more than the position before it; an image of ``t x h x w`` merged
tokens (placeholders in row-major order) starts at the next position ``s`` and gives its
token ``(i, j, k)`` the positions ``(s + i, s + j, s + k)``; the text after it starts at
``s + max(h, w)``. Every position after the prompt (decode, or prompt tokens preemption
turned into outputs) is its token index plus ``delta = max position + 1 - prompt length``
(transformers' ``rope_deltas``), the same in all three parts.

``MRopePositions`` keeps each admitted request's table (computed once, when the workers
see the request, new or resumed after preemption) and gives a step its positions:
``text_positions`` the [T] positions of the runner's position buffer (a text token's
shared part: what every step without image tokens, graphs included, feeds), and
``step_positions`` the [3, T] tensor for steps that feed image tokens. Prefix caching
needs nothing more: a block's positions depend only on the tokens and images before it,
which its hash chain covers.

``FlatPositions`` stands in for every other model (positions are token indices).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pagedlm.multimodal.tensors import from_tensor_data
from pagedlm.step import SchedulerOutput
from pagedlm.step.multimodal import MultiModalFeature


def prompt_positions(
    num_prompt_tokens: int, images: Sequence[tuple[int, tuple[int, int, int]]]
) -> tuple[np.ndarray, int]:
    """([3, num_prompt_tokens] int64 positions, delta) for a prompt whose images are
    (placeholder offset, merged grid (t, h, w)), sorted by offset."""
    positions = np.empty((3, num_prompt_tokens), dtype=np.int64)
    next_position, cursor = 0, 0
    for offset, (t, h, w) in images:
        text = offset - cursor
        positions[:, cursor:offset] = next_position + np.arange(text)
        next_position += text
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij"))
        positions[:, offset : offset + t * h * w] = next_position + grid.reshape(3, -1)
        next_position += max(h, w)
        cursor = offset + t * h * w
    positions[:, cursor:] = next_position + np.arange(num_prompt_tokens - cursor)
    next_position += num_prompt_tokens - cursor
    return positions, next_position - num_prompt_tokens


def merged_grid(feature: MultiModalFeature, merge: int) -> tuple[int, int, int]:
    """The image's grid of decoder tokens, from its ``image_grid_thw`` (in patches)."""
    t, h, w = (int(x) for x in from_tensor_data(feature.tensors["image_grid_thw"]).reshape(3))
    if t * (h // merge) * (w // merge) != feature.length:
        raise ValueError(
            f"an image's grid {t}x{h}x{w} (merge {merge}) does not match its "
            f"{feature.length} placeholder tokens"
        )
    return t, h // merge, w // merge


class FlatPositions:
    def update(self, scheduler_output: SchedulerOutput) -> None:
        pass

    def text_positions(self, req_ids, starts, num_new, positions: np.ndarray) -> np.ndarray:
        return positions

    def step_positions(self, positions: torch.Tensor, req_ids, starts, num_new) -> torch.Tensor:
        return positions


class MRopePositions:
    """Per-request M-RoPE tables on the worker (see the module docstring).

    A step's cost on the host: one dict lookup per request, one vectorized add, and a
    table lookup only for requests still in their prompt (decode never reads a table)."""

    def __init__(self, spatial_merge_size: int, device: torch.device) -> None:
        self.merge = spatial_merge_size
        self.device = device
        self.tables: dict[str, tuple[np.ndarray, int]] = {}
        """req_id -> ([3, num_prompt_tokens] positions, delta), for requests with images."""

    def update(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
            self.tables.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            if new.mm_features:
                images = [(f.offset, merged_grid(f, self.merge)) for f in new.mm_features]
                self.tables[new.req_id] = prompt_positions(new.num_prompt_tokens, images)

    def _offsets(self, req_ids, starts, num_new):
        """(per-token delta [T], then (token slice, table) of each request whose step
        reads its prompt table), or None when no request of the step has a table."""
        if not self.tables:
            return None
        tables = [self.tables.get(req_id) for req_id in req_ids]
        deltas = np.fromiter((0 if t is None else t[1] for t in tables), np.int64, len(tables))
        ends = np.cumsum(num_new)
        in_prompt = [
            (slice(int(end - n), int(end)), table)
            for table, start, n, end in zip(tables, starts, num_new, ends, strict=True)
            if table is not None and start < table[0].shape[1]
        ]
        return np.repeat(deltas, num_new), in_prompt

    @staticmethod
    def _prompt_rows(table: tuple[np.ndarray, int], indices: np.ndarray) -> tuple:
        """(mask of ``indices`` inside the prompt, their [3, n] table positions)."""
        prompt = indices < table[0].shape[1]
        return prompt, table[0][:, indices[prompt]]

    def text_positions(
        self,
        req_ids: Sequence[str],
        starts: np.ndarray,
        num_new: np.ndarray,
        positions: np.ndarray,
    ) -> np.ndarray:
        """[T] positions for the step's token indices ``positions`` (requests in order,
        from ``starts``, ``num_new`` tokens each): an image token's entry is its temporal
        part (steps with image tokens feed ``step_positions``)."""
        offsets = self._offsets(req_ids, starts, num_new)
        if offsets is None:
            return positions
        per_token, in_prompt = offsets
        out = positions + per_token
        for rows, table in in_prompt:
            prompt, table_rows = self._prompt_rows(table, positions[rows])
            out[rows][prompt] = table_rows[0]
        return out

    def step_positions(
        self,
        positions: torch.Tensor,
        req_ids: Sequence[str],
        starts: np.ndarray,
        num_new: np.ndarray,
    ) -> torch.Tensor:
        """[3, T] on the device for a step whose requests start at token ``starts`` and
        feed ``num_new`` tokens each (no padding rows: such steps run eager); computed on
        the host (``positions``, the [T] buffer, is not read back)."""
        indices = np.arange(int(num_new.sum())) + np.repeat(
            starts - np.cumsum(num_new) + num_new, num_new
        )
        offsets = self._offsets(req_ids, starts, num_new)
        if offsets is None:
            return positions
        per_token, in_prompt = offsets
        host = np.repeat((indices + per_token)[None, :], 3, axis=0)
        for rows, table in in_prompt:
            prompt, table_rows = self._prompt_rows(table, indices[rows])
            host[:, rows][:, prompt] = table_rows
        return torch.from_numpy(host).to(self.device, positions.dtype)


def make_positions(model: torch.nn.Module, device: torch.device) -> FlatPositions | MRopePositions:
    if not getattr(model, "uses_mrope", False):
        return FlatPositions()
    return MRopePositions(int(model.spatial_merge_size), device)
