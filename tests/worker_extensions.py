"""Worker extensions and functions for the ``collective_rpc`` tests, in a module of their own
so that worker processes can import them by name (the tests put ``tests/`` on their
``PYTHONPATH``)."""

from __future__ import annotations

import time

import torch

EMBEDDING = "model.embed_tokens.weight"
"""Vocab-parallel: each tensor-parallel rank holds its own rows of it."""


class RankProbe:
    """Mixed into every worker (``worker_extension_cls``): ``self`` is the worker."""

    def whoami(self, tag: str, suffix: str = "") -> dict:
        return {"tag": tag + suffix, "rank": self.rank, "class": type(self).__name__}

    def embedding_rows(self) -> list[int]:
        """(rows, first row's first value) of this rank's shard of the embedding."""
        weight = dict(self.get_model().named_parameters())[EMBEDDING]
        return [weight.shape[0], round(float(weight[0, 0]), 6)]

    def scale_embedding(self, factor: float) -> float:
        """A weight update in place, as a trainer's sync would do; the shard's new sum."""
        weight = dict(self.get_model().named_parameters())[EMBEDDING]
        with torch.no_grad():
            weight.mul_(factor)
        return round(float(weight.sum()), 3)

    def fail_on(self, rank: int) -> str:
        if self.rank == rank:
            raise ValueError(f"rank {rank} refuses")
        return "fine"

    def nap(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    def hand_back_a_tensor(self) -> torch.Tensor:
        return torch.zeros(2)

    def break_adapter_reads(self, rank: int) -> None:
        """From now on, LoRA adapters cannot be read on worker ``rank`` (files this rank
        cannot see); ``mend_adapter_reads`` undoes it."""
        from pagedlm.lora import manager

        if self.rank == rank:
            manager.load_adapter = _unreadable_adapter

    def mend_adapter_reads(self) -> None:
        from pagedlm.lora import manager, peft_format

        manager.load_adapter = peft_format.load_adapter


class Clashing:
    """Names a method the worker has: refused at start-up."""

    def sleep(self, level: int) -> None:
        raise AssertionError("never mixed in")


class InstanceClash:
    """Names an attribute every worker sets in ``__init__``: refused when a worker is built."""

    def config(self) -> None:
        raise AssertionError("hidden by the worker's config")


def _unreadable_adapter(path: str, *args, **kwargs):
    raise ValueError(f"{path} cannot be read here")


def rank_plus(worker, offset: int) -> int:
    """A function called on the worker by its importable name."""
    return worker.rank + offset


def embedding_shape(model: torch.nn.Module) -> list[int]:
    """For ``apply_model``: this rank's embedding shard's shape."""
    return list(dict(model.named_parameters())[EMBEDDING].shape)
