"""Reading ``pytorch_model*.bin`` weights, the format some draft heads are published in (the
EAGLE authors' checkpoints), without running code from the file.

``torch.load(weights_only=True)`` unpickles tensors and plain containers only; anything
else in the file is an error, never executed. Files are memory-mapped, so a shard's
tensors are read as they are copied into the model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

INDEX_FILE = "pytorch_model.bin.index.json"


def torch_bin_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The ``.bin`` weight files of ``directory`` (those its index names, else all)."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / name for name in names]
    return sorted(directory.glob("pytorch_model*.bin"))


def iter_torch_bin_weights(directory: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF tensor name, CPU tensor) for every tensor of every ``.bin`` shard."""
    for path in torch_bin_files(directory):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # the unpickler refuses anything but tensors
            raise ValueError(
                f"{path} is not a plain weights file ({exc}); pagedlm loads only tensors "
                "from .bin files. Convert it to safetensors with transformers."
            ) from None
        yield from state.items()
        del state
