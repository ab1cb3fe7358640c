"""Custom logits processors for the tests, importable by name (``sample.logits_processor_
examples:Class``) in an engine-core process that has ``tests/`` on its ``PYTHONPATH``."""

from __future__ import annotations

import torch

from pagedlm.sample.logits_processor import (
    AdapterLogitsProcessor,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    process_dict_updates,
)
from pagedlm.sampling_params import SamplingParams


class TargetToken(LogitsProcessor):
    """vLLM's example: a request with ``extra_args={"target_token": t}`` generates only t."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        target = (sampling_params.extra_args or {}).get("target_token")
        if target is not None and (isinstance(target, bool) or not isinstance(target, int)):
            raise ValueError(f"target_token must be a token id, got {target!r}")

    def __init__(self, config, device: torch.device, is_pin_memory: bool) -> None:
        self.targets: dict[int, int] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(
            self.targets,
            batch_update,
            lambda params, _prompt, _output: (params.extra_args or {}).get("target_token"),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.targets:
            return logits
        rows = torch.tensor(list(self.targets), dtype=torch.long, device=logits.device)
        cols = torch.tensor(list(self.targets.values()), dtype=torch.long, device=logits.device)
        kept = logits[rows, cols]
        logits[rows] = float("-inf")
        logits[rows, cols] = kept
        return logits


class CountUp(AdapterLogitsProcessor):
    """``extra_args={"count_from": k}``: output token i is ``k + i`` (mod the vocabulary);
    reads the request's live output list, so it fails if a token is missing."""

    def __init__(self, config, device: torch.device, is_pin_memory: bool) -> None:
        super().__init__(config, device, is_pin_memory)
        self.vocab_size = config.model.arch.vocab_size

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams):
        start = (params.extra_args or {}).get("count_from")
        if start is None:
            return None

        def force(output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
            if output_ids and output_ids[-1] != (start + len(output_ids) - 1) % self.vocab_size:
                raise AssertionError(f"the output list is not the generated tokens: {output_ids}")
            token = (start + len(output_ids)) % self.vocab_size
            forced = torch.full_like(row, float("-inf"))
            forced[token] = 0.0
            return forced

        return force


class EchoPrompt(AdapterLogitsProcessor):
    """``extra_args={"echo": True}``: repeats the prompt (a three-argument callable)."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams):
        if not (params.extra_args or {}).get("echo"):
            return None

        def echo(prompt_ids: list[int], output_ids: list[int], row: torch.Tensor):
            row.fill_(float("-inf"))
            row[prompt_ids[len(output_ids) % len(prompt_ids)]] = 0.0
            return row

        return echo


class TopOne(LogitsProcessor):
    """Argmax-invariant: ``extra_args={"top_one": True}`` keeps only each row's largest
    logit, so a random request samples what a greedy one would."""

    def __init__(self, config, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, bool] = {}
        self.applied = 0

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(
            self.rows,
            batch_update,
            lambda params, _p, _o: True if (params.extra_args or {}).get("top_one") else None,
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        self.applied += 1
        for index in self.rows:
            row = logits[index]
            keep = row.argmax()
            value = row[keep].clone()
            row.fill_(float("-inf"))
            row[keep] = value
        return logits


class StrictBatch(LogitsProcessor):
    """Checks the ``BatchUpdate`` promises on every step (free indices on add and on a
    one-way move, rows == batch size) and that each request keeps its output list."""

    def __init__(self, config, device: torch.device, is_pin_memory: bool) -> None:
        self.slots: dict[int, list[int]] = {}
        self.max_num_seqs = config.scheduler.max_num_seqs

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            assert index in self.slots, (index, self.slots.keys())
            del self.slots[index]
        for index, _params, prompt, output in batch_update.added:
            assert index not in self.slots and 0 <= index < self.max_num_seqs, index
            assert prompt
            self.slots[index] = output
        for source, target, direction in batch_update.moved:
            if direction is MoveDirectionality.UNIDIRECTIONAL:
                assert target not in self.slots, (source, target)
                self.slots[target] = self.slots.pop(source)
            else:
                self.slots[source], self.slots[target] = self.slots[target], self.slots[source]
        assert sorted(self.slots) == list(range(batch_update.batch_size)), self.slots.keys()

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        assert logits.shape[0] == len(self.slots), (logits.shape, len(self.slots))
        return logits
