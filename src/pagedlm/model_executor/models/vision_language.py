"""What vision-language models share around their decoder: checkpoint names mapped onto
ours, and the vision-side tensors copied straight into their parameters while the
decoder's go on to the decoder's own loader (stacked q/k/v, tensor parallelism)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

VLM_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.visual.", "visual."),
)
"""(checkpoint prefix, our prefix), first match wins: transformers 5's names
(``model.language_model.*``, ``model.vision_tower.*``) and the older ones
(``language_model.model.*``, ``vision_tower.vision_model.*``) onto ``model.*``,
``lm_head.*``, ``vision_tower.*`` and ``multi_modal_projector.*``; Qwen2.5-VL's tower
(``model.visual.*`` or ``visual.*``, its merger inside) onto ``visual.*``."""
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "visual.")


def require_one_stage() -> None:
    """Vision-language models run on one pipeline stage (their image embeddings feed the
    first layer and nothing sends them on)."""
    from pagedlm.distributed.parallel_state import get_pipeline_state

    if get_pipeline_state().world_size > 1:
        raise ValueError(
            "vision-language models do not run with pipeline parallelism yet; set "
            "pipeline_parallel_size=1."
        )


def split_vision_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    unused: tuple[str, ...],
    loaded: set[str],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the decoder's tensors (renamed by ``VLM_RENAMES``); copy those under
    ``VISION_PREFIXES`` into ``model``'s parameters, adding their names to ``loaded``.

    A vision tensor with no parameter is skipped if its name contains one of ``unused``
    (parts the model never runs), else refused: the config and the checkpoint disagree.
    """
    params = {n: p for n, p in model.named_parameters() if n.startswith(VISION_PREFIXES)}
    for name, tensor in weights:
        for old, new in VLM_RENAMES:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        if not name.startswith(VISION_PREFIXES):
            yield name, tensor
            continue
        if name not in params:
            if any(part in name for part in unused):
                continue
            raise ValueError(
                f"checkpoint tensor {name!r} has no parameter in {type(model).__name__}; "
                "check config.json's vision_config."
            )
        params[name].copy_(tensor)
        loaded.add(name)
