"""Reading a HF model directory's ``*.safetensors`` files (one or many shards), tensor by tensor.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping each
tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the
end of the header), then the raw little-endian tensor bytes.

We read each tensor with ``readinto`` into a buffer of its own instead of going through
``safetensors.safe_open``: ``safe_open`` memory-maps the file, and every page it touches
counts as resident until the handle closes, so a single-file checkpoint peaks at twice its
size (measured: 2.0x for a 400 MB file). Plain reads leave the data in the page cache, which
is not charged to the process, so peak RSS stays at the model plus one tensor.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from pagedlm.model_executor.loader.safetensors_slice import SafetensorsSlice, read_buffer
from pagedlm.model_executor.loader.weight_files import SAFETENSORS_INDEX_FILE, checkpoint_files

INDEX_FILE = SAFETENSORS_INDEX_FILE
_MAX_HEADER_BYTES = 100 * 1024 * 1024

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,  # FP8 checkpoints (quantization/fp8_checkpoint.py)
}


@dataclass(frozen=True)
class SafetensorsEntry:
    """One tensor of a file: dtype, HF-order shape and absolute byte range."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def safetensors_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The weight files of ``directory``: those its index names, else its *.safetensors but
    second copies (``weight_files.checkpoint_files`` with ``load_format="safetensors"``).

    The index wins because some repositories also ship a second copy of the weights in
    another layout (e.g. Mistral's ``consolidated.safetensors``).
    """
    return list(checkpoint_files(directory, "safetensors").files)


def read_safetensors_header(path: str | os.PathLike[str]) -> list[SafetensorsEntry]:
    """The tensors of one file in file order; checks that every byte range lies in the file."""
    size = os.path.getsize(path)
    with open(path, "rb") as file:
        prefix = file.read(8)
        (header_len,) = struct.unpack("<Q", prefix) if len(prefix) == 8 else (-1,)
        if not 0 < header_len <= min(_MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{path} is not a safetensors file (bad header length); re-save it.")
        try:
            header = json.loads(file.read(header_len))
        except ValueError:
            raise ValueError(f"{path} has a corrupt safetensors header; re-save it.") from None
    data_start = 8 + header_len
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(
                f"{path}: tensor {name} has dtype {info['dtype']}, which pagedlm does not read; "
                "re-save the checkpoint in float32, bfloat16 or float16."
            )
        begin, end = (data_start + offset for offset in info["data_offsets"])
        if end > size:
            raise ValueError(
                f"{path} is truncated (tensor {name} runs past the end); download it again."
            )
        entries.append(
            SafetensorsEntry(name, _DTYPES[info["dtype"]], tuple(info["shape"]), begin, end)
        )
    return sorted(entries, key=lambda entry: entry.begin)


def safetensors_shapes(
    directory: str | os.PathLike[str],
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """HF tensor name -> (shape, dtype) over every shard, from the headers only."""
    return {
        entry.name: (entry.shape, entry.dtype)
        for path in safetensors_files(directory)
        for entry in read_safetensors_header(path)
    }


def _read_tensor(file: BinaryIO, entry: SafetensorsEntry) -> torch.Tensor:
    nbytes = entry.end - entry.begin
    buffer = read_buffer(nbytes)
    file.seek(entry.begin)
    if nbytes and file.readinto(buffer) != nbytes:
        raise ValueError(f"{file.name} ended inside tensor {entry.name}; download it again.")
    raw = (
        torch.frombuffer(buffer, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
    )
    return raw.view(entry.dtype).reshape(entry.shape)


def iter_safetensors_weights(
    directory: str | os.PathLike[str],
    slices: bool = False,
    select: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (HF tensor name, CPU tensor in the file's dtype) for every tensor of every shard
    (every one whose name ``select`` accepts, when given; the others are not read).

    Each tensor is read into its own buffer just before it is yielded; the consumer copies it
    into its parameter and drops it, so at most about two tensors exist besides the model.
    With ``slices`` (tensor parallelism) each is a ``SafetensorsSlice`` instead, read only
    when used, and only the part the weight loader narrowed it to.
    """
    for path in safetensors_files(directory):
        entries = read_safetensors_header(path)
        if select is not None:
            entries = [entry for entry in entries if select(entry.name)]
        if slices:
            for entry in entries:
                lazy = SafetensorsSlice(path, entry.name, entry.dtype, entry.begin, entry.shape)
                yield entry.name, lazy  # type: ignore[misc]
            continue
        with open(path, "rb", buffering=0) as file:
            for entry in entries:
                tensor = _read_tensor(file, entry)
                yield entry.name, tensor
                del tensor  # before reading the next one, so two never pile up here
