"""What vision-language models share around their decoder: checkpoint names mapped onto
ours, and the vision-side tensors copied straight into their parameters while the
decoder's go on to the decoder's own loader (stacked q/k/v, tensor parallelism)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn


def split_vision_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    renames: tuple[tuple[str, str], ...],
    vision_prefixes: tuple[str, ...],
    unused: tuple[str, ...],
    loaded: set[str],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the decoder's tensors (renamed); copy those under ``vision_prefixes`` into
    ``model``'s parameters, adding their names to ``loaded``.

    ``renames``: (checkpoint prefix, our prefix), first match wins. A vision tensor with
    no parameter is skipped if its name contains one of ``unused`` (parts the model never
    runs), else refused: the config and the checkpoint disagree.
    """
    params = {n: p for n, p in model.named_parameters() if n.startswith(vision_prefixes)}
    for name, tensor in weights:
        for old, new in renames:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        if not name.startswith(vision_prefixes):
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
