"""Reading a HF model directory's ``*.safetensors`` files, one tensor at a time."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The weight files of ``directory``: those its index names, else every *.safetensors.

    The index wins because some repositories also ship a second copy of the weights in
    another layout (e.g. Mistral's ``consolidated.safetensors``).
    """
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(
                f"{index} names weight files that are not there: {missing}; "
                "download the complete model directory."
            )
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{directory} has no *.safetensors files; pagedlm reads safetensors or GGUF. "
            "Convert the weights with transformers (model.save_pretrained(dir)) or pass a .gguf."
        )
    return files


def iter_safetensors_weights(
    directory: str | os.PathLike[str],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (HF tensor name, CPU tensor) for every tensor of every weight file.

    Files are memory-mapped and tensors produced one at a time, so loading never holds
    a second full copy of the model in memory.
    """
    from safetensors import safe_open

    for path in safetensors_files(directory):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)
