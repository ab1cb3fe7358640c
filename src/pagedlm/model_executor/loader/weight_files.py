"""Which files of a Hugging Face model directory hold its weights, by ``load_format``.

vLLM's rules, which pagedlm follows:

- ``"safetensors"``: the ``*.safetensors`` files ``model.safetensors.index.json`` names,
  else all of them but second copies (below).
- ``"pt"``: PyTorch's pickle format: the ``.bin`` files, else the ``*.pt`` files. Of the
  ``.bin`` files, those ``pytorch_model.bin.index.json`` names (transformers' sharded
  layout), else ``pytorch_model*.bin``, else every other ``*.bin``. (vLLM's own ``pt``
  globs ``*.pt`` only, although its documentation calls it "the pytorch bin format";
  transformers writes ``.bin``, so pagedlm reads those first.)
- ``"auto"``: safetensors when the directory has any, else the ``"pt"`` files.

A load never reads the same weights twice. Where an index exists it decides, as vLLM's
``filter_duplicate_safetensors_files`` does: a single-file copy beside the shards
(``model.safetensors`` beside ``model-00001-of-00002.safetensors``, ...) or Mistral's
``consolidated.safetensors`` is not read. Without an index, Mistral's ``consolidated*``
files give way to any other weight file, and a shard set gives way to the single file of
its name, which is what transformers reads first. A trainer's or accelerate's state saved
beside the weights (``training_args.bin``, ``optimizer.pt``, ...; vLLM's
``filter_files_not_needed_for_inference``) is never taken for weights.

The rules look at file names (and an index's ``weight_map``) only, so the hub applies them
to a repository's listing before any weight is downloaded (``hub.hub_allow_patterns``);
this module imports no torch.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

PYTORCH_INDEX_FILE = "pytorch_model.bin.index.json"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
WEIGHT_FORMATS = ("auto", "safetensors", "pt")
"""The load formats that read a directory's weight files."""

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

_SHARD = re.compile(r"(?P<stem>.+)-\d+-of-\d+(?P<suffix>\.[^.]+)")

IndexReader = Callable[[str], list[str]]
"""An index file's name -> the sorted file names its ``weight_map`` lists (``index_names``)."""


@dataclass(frozen=True)
class WeightNames:
    """The weight files a load reads, chosen from a directory's (or repository's) names."""

    format: str
    """``"safetensors"`` or ``"pt"`` (PyTorch pickles, read with ``weights_only``)."""
    names: tuple[str, ...]
    """Paths relative to the directory (an index may name files in a subfolder)."""
    index: str | None = None
    """The index the names come from; None: chosen by name."""
    fell_back: bool = False
    """``load_format="auto"`` took the PyTorch files: there are no safetensors."""


@dataclass(frozen=True)
class CheckpointFiles:
    """The weight files of one directory and the format they are read in."""

    format: str
    """``"safetensors"`` or ``"pt"`` (PyTorch pickles, read with ``weights_only``)."""
    files: tuple[Path, ...]
    fell_back: bool = False
    """``load_format="auto"`` took the PyTorch files: the directory has no safetensors."""


def without_second_copies(names: Iterable[str]) -> list[str]:
    """``names`` (sorted) less the files that repeat weights another one of them holds:
    Mistral's ``consolidated*`` files beside any other, and a shard set
    (``<stem>-00001-of-00002<suffix>``, ...) beside the single file ``<stem><suffix>``."""
    names = sorted(names)
    present = set(names)
    kept = [name for name in names if not _is_shard_of_a_single_file(name, present)]
    others = [name for name in kept if not name.startswith("consolidated")]
    return others or kept


def _is_shard_of_a_single_file(name: str, present: set[str]) -> bool:
    match = _SHARD.fullmatch(name)
    return match is not None and match["stem"] + match["suffix"] in present


def safetensors_weight_names(names: Iterable[str]) -> list[str]:
    """The safetensors weight files among a directory's root-level names, by name (for a
    directory without ``model.safetensors.index.json``)."""
    return without_second_copies(n for n in names if "/" not in n and n.endswith(".safetensors"))


def pickle_weight_names(names: Iterable[str]) -> list[str]:
    """The weight files among a directory's file names (or a hub repository's root-level
    paths), by the ``"pt"`` rules; the index, when there is one, is applied by the caller."""
    candidates = sorted(
        name for name in names if "/" not in name and not name.endswith(NOT_WEIGHTS)
    )
    transformers_names = [name for name in candidates if fnmatch(name, "pytorch_model*.bin")]
    if transformers_names:
        return without_second_copies(transformers_names)
    other_bins = [name for name in candidates if name.endswith(".bin")]
    return without_second_copies(other_bins or [n for n in candidates if n.endswith(".pt")])


def index_names(index: Path, shown_as: str | None = None) -> list[str]:
    """The sorted file names the ``weight_map`` of the index file ``index`` lists
    (``shown_as`` names it in errors; None: its path)."""
    try:
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(
            f"{shown_as or index} is not a valid index (no 'weight_map': {error}); download it "
            "again, or delete it so that the weight files are chosen by name."
        ) from None


def choose_weight_names(
    names: Iterable[str], load_format: str, where: str, read_index: IndexReader
) -> WeightNames:
    """The weight files ``load_format`` (``"auto"``, ``"safetensors"`` or ``"pt"``) reads
    among ``names`` (the files of ``where``, a directory or a hub repository; only
    root-level ones count); ``read_index`` reads an index that is among them. A
    ``ValueError`` naming the fix when there are none."""
    if load_format not in WEIGHT_FORMATS:
        raise ValueError(f"load_format={load_format!r} reads no weight files of a directory.")
    root = {name for name in names if "/" not in name}
    pickles = PYTORCH_INDEX_FILE in root or bool(pickle_weight_names(root))
    safetensors = SAFETENSORS_INDEX_FILE in root or bool(safetensors_weight_names(root))
    if load_format == "safetensors" or (load_format == "auto" and safetensors):
        if not safetensors:
            if pickles:
                raise ValueError(
                    f"load_format='safetensors' reads *.safetensors files, but {where} has "
                    "PyTorch .bin/.pt weights only; use load_format='auto' or 'pt'."
                )
            raise ValueError(
                f"{where} has no *.safetensors files. Save the weights with transformers "
                '(model.save_pretrained(dir)), pass a .gguf, or use load_format="dummy" for '
                "random weights (PyTorch .bin/.pt weights: load_format='auto' or 'pt')."
            )
        if SAFETENSORS_INDEX_FILE in root:
            indexed = tuple(read_index(SAFETENSORS_INDEX_FILE))
            return WeightNames("safetensors", indexed, SAFETENSORS_INDEX_FILE)
        return WeightNames("safetensors", tuple(safetensors_weight_names(root)))
    fell_back = load_format == "auto"
    if PYTORCH_INDEX_FILE in root:
        indexed = tuple(read_index(PYTORCH_INDEX_FILE))
        return WeightNames("pt", indexed, PYTORCH_INDEX_FILE, fell_back)
    if pickles:
        return WeightNames("pt", tuple(pickle_weight_names(root)), None, fell_back)
    if load_format == "pt":
        has = (
            " (it has *.safetensors files: use load_format='auto' or 'safetensors')"
            if safetensors
            else ""
        )
        raise ValueError(
            f"load_format='pt' reads PyTorch weight files (pytorch_model*.bin, other *.bin, "
            f"or *.pt), but {where} has none{has}."
        )
    raise ValueError(
        f"{where} has no weights: no *.safetensors files and no PyTorch .bin/.pt files "
        "(a trainer's training_args.bin or optimizer.pt are not weights). Save the model "
        'with transformers (model.save_pretrained(dir)), pass a .gguf, or use load_format="dummy" '
        "for random weights."
    )


def checkpoint_files(directory: str | os.PathLike[str], load_format: str) -> CheckpointFiles:
    """The weight files ``load_format`` (``"auto"``, ``"safetensors"`` or ``"pt"``) reads
    in ``directory`` (``choose_weight_names``); a ``ValueError`` naming the fix when there
    are none, or when its index names files it does not have."""
    directory = Path(directory)
    chosen = choose_weight_names(
        _file_names(directory), load_format, str(directory), lambda i: index_names(directory / i)
    )
    files = tuple(directory / name for name in chosen.names)
    missing = [name for name, path in zip(chosen.names, files, strict=True) if not path.is_file()]
    if missing:
        raise ValueError(
            f"{directory / str(chosen.index)} lists shard files that are not in {directory}: "
            f"{', '.join(missing)}; download the complete model directory (every shard the "
            "index names)."
        )
    return CheckpointFiles(chosen.format, files, chosen.fell_back)


def _file_names(directory: Path) -> list[str]:
    try:
        return [entry.name for entry in os.scandir(directory) if entry.is_file()]
    except (NotADirectoryError, FileNotFoundError):
        return []
