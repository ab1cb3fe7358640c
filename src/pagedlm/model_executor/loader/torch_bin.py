"""Reading PyTorch pickle weights (``pytorch_model*.bin``, ``*.pt``: ``load_format="pt"``, or
``"auto"`` on a directory without safetensors, as the EAGLE authors publish their heads)
without running code from the file.

``torch.load(weights_only=True)`` unpickles tensors and plain containers only; anything
else in the file is an error, never executed. torch reads a shard as one object, so shards
are read one at a time, each dropped before the next is opened. Files in torch's zip format
(every ``torch.save`` since 1.6) are memory-mapped, so a tensor's bytes are read as it is
copied into the model (a tensor-parallel rank touches mostly the rows it keeps); older
files are read whole.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch


def iter_torch_bin_weights(
    files: Iterable[str | os.PathLike[str]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF tensor name, CPU tensor) for every tensor of every file, file after file.

    ``files`` come from ``weight_files.checkpoint_files``. A file that is not a plain
    mapping of names to tensors is a ``ValueError`` naming it."""
    for path in map(Path, files):
        state = _load_plain(path)
        for name, value in state.items():
            if not isinstance(name, str) or not isinstance(value, torch.Tensor):
                raise ValueError(
                    f"{path} is not a weights file: its entry {name!r} is a "
                    f"{type(value).__name__}, not a tensor. Move it out of the model directory "
                    "(or list the weight files in pytorch_model.bin.index.json)."
                )
            yield name, value
        del state  # the shard's mapping closes once the model holds copies only


def _load_plain(path: Path) -> dict:
    try:
        state = torch.load(
            path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path)
        )
    except Exception as error:  # the restricted unpickler refuses anything but tensors
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(
            f"{path} cannot be read as plain weights ({reason}); pagedlm reads .bin/.pt files "
            "with torch.load(weights_only=True) and never unpickles anything else. Convert "
            "the checkpoint to safetensors (load it where you trust its code, then "
            "save_pretrained(dir) with transformers) and load that directory."
        ) from None
    if not isinstance(state, dict):
        raise ValueError(
            f"{path} holds a {type(state).__name__}, not a mapping of tensor names to tensors; "
            "it is not a weights file. Move it out of the model directory."
        )
    return state
