"""Building only this pipeline stage's part of a model.

A stage holds layers ``[start, end)`` (``distributed.pipeline.this_stage_layers``); the
first stage also holds the token embedding, the last the final norm and the LM head (and,
with tied embeddings, the embedding the head shares). Modules of other stages are
``PPMissingLayer`` placeholders, so parameter names keep their checkpoint spelling and
layer indices stay global (a layer's KV cache is found by its global index).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from pagedlm.distributed.parallel_state import get_pipeline_state
from pagedlm.distributed.pipeline import this_stage_layers


class PPMissingLayer(nn.Module):
    """Stands for a module another pipeline stage holds: no parameters, never called."""

    def forward(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("this module lives on another pipeline stage")


def stage_layers(num_layers: int, build: Callable[[int], nn.Module]) -> nn.ModuleList:
    """``build(i)`` for this stage's layers, placeholders for the others'."""
    start, end = this_stage_layers(num_layers)
    return nn.ModuleList(
        build(i) if start <= i < end else PPMissingLayer() for i in range(num_layers)
    )


def on_first_stage(build: Callable[[], nn.Module], also_last: bool = False) -> nn.Module:
    """The module on the first stage (and the last one if ``also_last``), else a placeholder."""
    pp = get_pipeline_state()
    return build() if pp.is_first or (also_last and pp.is_last) else PPMissingLayer()


def on_last_stage(build: Callable[[], nn.Module]) -> nn.Module:
    return build() if get_pipeline_state().is_last else PPMissingLayer()


def missing_prefixes(model: nn.Module) -> tuple[str, ...]:
    """``"name."`` of every placeholder in ``model``: checkpoint tensors under these
    belong to other stages and are skipped when loading."""
    return tuple(f"{name}." for name, m in model.named_modules() if isinstance(m, PPMissingLayer))
