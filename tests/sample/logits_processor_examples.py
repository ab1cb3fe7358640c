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


class RaiseAt(AdapterLogitsProcessor):
    """A per-request processor that fails: ``extra_args={"raise_at": k}`` makes the
    request's callable raise once the request has ``k`` output tokens;
    ``{"raise_on_params": True}`` makes ``new_req_logits_processor`` raise."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams):
        args = params.extra_args or {}
        if args.get("raise_on_params"):
            raise KeyError("no callable for these parameters")
        at = args.get("raise_at")
        if at is None:
            return None

        def count(output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
            if len(output_ids) >= at:
                raise ValueError(f"boom after {len(output_ids)} tokens")
            return row

        return count


class BatchRaise(LogitsProcessor):
    """A batch processor that fails: ``extra_args={"batch_raise": "apply"}`` makes ``apply``
    raise while such a request is in the batch; ``"update_state"`` makes ``update_state``
    raise when one is added, after taking the removals and the additions before it. Checks
    on every update that the rows it holds are the batch's (so a stale state shows)."""

    def __init__(self, config, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, str | None] = {}
        self.size = 0

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _prompt, _output in batch_update.added:
            how = (params.extra_args or {}).get("batch_raise")
            if how == "update_state":
                raise RuntimeError("cannot take this request")
            self.rows[index] = how
        for source, target, direction in batch_update.moved:
            if direction is MoveDirectionality.SWAP:
                self.rows[source], self.rows[target] = self.rows[target], self.rows[source]
            else:
                self.rows[target] = self.rows.pop(source)
        self.size = batch_update.batch_size
        assert sorted(self.rows) == list(range(self.size)), (self.rows, self.size)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        assert logits.shape[0] == self.size, (logits.shape, self.size)
        if "apply" in self.rows.values():
            raise RuntimeError("this batch breaks me")
        return logits
