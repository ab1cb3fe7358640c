"""Which files of a Hugging Face model directory hold its weights, by ``load_format``.

vLLM's rules, which pagedlm follows:

- ``"safetensors"``: the ``*.safetensors`` files (those ``model.safetensors.index.json``
  names, else all of them: ``safetensors_loader.safetensors_files``).
- ``"pt"``: PyTorch's pickle format: the ``.bin`` files, else the ``*.pt`` files. Of the
  ``.bin`` files, those ``pytorch_model.bin.index.json`` names (transformers' sharded
  layout), else ``pytorch_model*.bin``, else every other ``*.bin``. (vLLM's own ``pt``
  globs ``*.pt`` only, although its documentation calls it "the pytorch bin format";
  transformers writes ``.bin``, so pagedlm reads those first.)
- ``"auto"``: safetensors when the directory has any, else the ``"pt"`` files.

A trainer's or accelerate's state saved beside the weights (``training_args.bin``,
``optimizer.pt``, ``scheduler.pt``, ...) is never taken for weights. The rules look at file
names only, so the hub applies them to a repository's listing before anything is
downloaded (``hub.hub_allow_patterns``); this module imports no torch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

PYTORCH_INDEX_FILE = "pytorch_model.bin.index.json"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"

NOT_WEIGHTS = (
    "training_args.bin",  # transformers' Trainer
    "optimizer.bin",  # accelerate
    "optimizer.pt",  # Trainer
    "scheduler.bin",  # accelerate
    "scheduler.pt",  # Trainer
    "scaler.pt",  # Trainer and accelerate (mixed precision)
    "adapter_model.bin",  # a PEFT adapter: served with enable_lora, not as the model
)
"""Name endings of pickle files that are not a model's weights (vLLM's list, plus
accelerate's and PEFT's names)."""


@dataclass(frozen=True)
class CheckpointFiles:
    """The weight files of one directory and the format they are read in."""

    format: str
    """``"safetensors"`` or ``"pt"`` (PyTorch pickles, read with ``weights_only``)."""
    files: tuple[Path, ...]
    fell_back: bool = False
    """``load_format="auto"`` took the PyTorch files: the directory has no safetensors."""


def pickle_weight_names(names: Iterable[str]) -> list[str]:
    """The weight files among a directory's file names (or a hub repository's root-level
    paths), by the ``"pt"`` rules; the index, when there is one, is applied by the caller."""
    candidates = sorted(
        name for name in names if "/" not in name and not name.endswith(NOT_WEIGHTS)
    )
    transformers_names = [name for name in candidates if fnmatch(name, "pytorch_model*.bin")]
    if transformers_names:
        return transformers_names
    other_bins = [name for name in candidates if name.endswith(".bin")]
    return other_bins or [name for name in candidates if name.endswith(".pt")]


def pickle_weight_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The PyTorch weight files of ``directory`` (those its index names, else
    ``pickle_weight_names`` of its files); empty when it has none."""
    directory = Path(directory)
    index = directory / PYTORCH_INDEX_FILE
    if not index.is_file():
        return [directory / name for name in pickle_weight_names(_file_names(directory))]
    try:
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(
            f"{index} is not a valid index (no 'weight_map': {error}); download it again or "
            "delete it so that the pytorch_model*.bin files are read."
        ) from None
    files = [directory / name for name in names]
    missing = [name for name, path in zip(names, files, strict=True) if not path.is_file()]
    if missing:
        raise ValueError(
            f"{index} lists shard files that are not in {directory}: {', '.join(missing)}; "
            "download the complete model directory (every shard the index names)."
        )
    return files


def has_safetensors(directory: str | os.PathLike[str]) -> bool:
    directory = Path(directory)
    return (directory / SAFETENSORS_INDEX_FILE).is_file() or any(directory.glob("*.safetensors"))


def checkpoint_files(directory: str | os.PathLike[str], load_format: str) -> CheckpointFiles:
    """The weight files ``load_format`` (``"auto"``, ``"safetensors"`` or ``"pt"``) reads
    in ``directory``; a ``ValueError`` naming the fix when there are none."""
    directory = Path(directory)
    if load_format not in ("auto", "safetensors", "pt"):
        raise ValueError(f"load_format={load_format!r} reads no weight files of a directory.")
    safetensors = has_safetensors(directory)
    if load_format == "safetensors" or (load_format == "auto" and safetensors):
        if not safetensors and pickle_weight_files(directory):
            raise ValueError(
                f"load_format='safetensors' reads *.safetensors files, but {directory} has "
                "PyTorch .bin/.pt weights only; use load_format='auto' or 'pt'."
            )
        from pagedlm.model_executor.loader.safetensors_loader import safetensors_files

        return CheckpointFiles("safetensors", tuple(safetensors_files(directory)))
    files = pickle_weight_files(directory)
    if files:
        return CheckpointFiles("pt", tuple(files), fell_back=load_format == "auto")
    if load_format == "pt":
        has = (
            " (it has *.safetensors files: use load_format='auto' or 'safetensors')"
            if safetensors
            else ""
        )
        raise ValueError(
            f"load_format='pt' reads PyTorch weight files (pytorch_model*.bin, other *.bin, "
            f"or *.pt), but {directory} has none{has}."
        )
    raise ValueError(
        f"{directory} has no weights: no *.safetensors files and no PyTorch .bin/.pt files "
        "(a trainer's training_args.bin or optimizer.pt are not weights). Save the model "
        'with transformers (model.save_pretrained(dir)), pass a .gguf, or use load_format="dummy" '
        "for random weights."
    )


def _file_names(directory: Path) -> list[str]:
    try:
        return [entry.name for entry in os.scandir(directory) if entry.is_file()]
    except NotADirectoryError:
        return []
