"""The GGUF container: header (metadata, tensor infos) and raw tensor bytes, no model knowledge.

A GGUF file is a little-endian header (magic, version, key/value metadata, tensor infos)
followed by aligned tensor data. We parse the header ourselves with ``struct`` because
``gguf.GGUFReader`` builds a numpy view per array element and takes seconds on a 49k-token
vocabulary; the ``gguf`` package is imported only to dequantize tensor data.

GGUF lists dimensions fastest-varying first, so a ``[out_features, in_features]`` HF matrix is
stored with dims ``(in_features, out_features)``; ``GGUFTensorInfo.shape`` is already reversed
into HF (row-major) order.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import torch

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_BOOL, _STRING, _ARRAY = 7, 8, 9
_LENGTH = struct.Struct("<Q")
# GGUF value type -> struct format of one scalar (little-endian).
_SCALAR_FORMATS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i",
    6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in the file. ``shape`` is in HF order, e.g. ``[out, in]``."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    """Absolute byte offset of the tensor data in the file."""


@dataclass(frozen=True)
class GGUFHeader:
    """Everything before the tensor data: metadata (arrays as Python lists) and tensor infos."""

    path: str
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]


class _Cursor:
    """Sequential little-endian reader over the mapped file; a clear error past its end."""

    def __init__(self, buffer: mmap.mmap, path: str) -> None:
        self.buffer = buffer
        self.path = path
        self.pos = 0

    def _truncated(self) -> ValueError:
        return ValueError(f"{self.path} is truncated (header ends early); download it again.")

    def scalar(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        except struct.error:
            raise self._truncated() from None
        self.pos += struct.calcsize(fmt)
        if fmt == "<f":
            # The shortest decimal that round-trips through float32 is the value the writer
            # meant (1e-05, not 9.999999747378752e-06).
            return float(str(np.float32(value)))
        return value

    def strings(self, count: int) -> list[str]:
        # Vocabularies hold ~10^5 strings; a tight loop keeps header parsing near 0.1 s.
        buffer, pos, unpack_length = self.buffer, self.pos, _LENGTH.unpack_from
        strings = []
        try:
            for _ in range(count):
                (length,) = unpack_length(buffer, pos)
                strings.append(buffer[pos + 8 : pos + 8 + length].decode("utf-8"))
                pos += 8 + length
        except struct.error:
            raise self._truncated() from None
        if pos > len(buffer):
            raise self._truncated()
        self.pos = pos
        return strings

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.strings(1)[0]
        if value_type == _ARRAY:
            item_type, count = self.scalar("<I"), self.scalar("<Q")
            if item_type == _STRING:
                return self.strings(count)
            if item_type in _SCALAR_FORMATS and item_type != _BOOL:
                # Numeric arrays (scores, token types) in one numpy call instead of a loop.
                dtype = np.dtype(_SCALAR_FORMATS[item_type])
                if self.pos + dtype.itemsize * count > len(self.buffer):
                    raise self._truncated()
                items = np.frombuffer(self.buffer, dtype, count, self.pos).tolist()
                self.pos += dtype.itemsize * count
                return items
            return [self.value(item_type) for _ in range(count)]
        if value_type not in _SCALAR_FORMATS:
            raise ValueError(f"{self.path}: unknown GGUF value type {value_type}; is it GGUF?")
        return self.scalar(_SCALAR_FORMATS[value_type])


def read_gguf_header(path: str) -> GGUFHeader:
    """Parse the metadata and tensor infos of a GGUF (version 2 or 3) file; reads no tensor data.

    The tokenizer, the config, the loader and the quantized kernels all read the header of
    the same file at start-up; it is parsed once per (path, size, modification time) and
    shared (callers treat it as read-only), saving ~0.2 s per read on the embedded model.
    """
    stat = os.stat(path)
    return _read_gguf_header(os.path.abspath(path), stat.st_size, stat.st_mtime_ns, path)


@functools.lru_cache(maxsize=8)
def _read_gguf_header(_key: str, _size: int, _mtime_ns: int, path: str) -> GGUFHeader:
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        cursor = _Cursor(buffer, path)
        if buffer[:4] != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file (it does not start with b'GGUF').")
        cursor.pos = 4
        version = cursor.scalar("<I")
        if version not in (2, 3):
            hint = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
            raise ValueError(
                f"{path} has GGUF version {version}{hint}; only little-endian versions 2 and 3 "
                "are supported. Re-convert it with a recent llama.cpp convert_hf_to_gguf.py."
            )
        num_tensors, num_metadata = cursor.scalar("<Q"), cursor.scalar("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(num_metadata):
            key = cursor.strings(1)[0]
            metadata[key] = cursor.value(cursor.scalar("<I"))
        infos = []
        for _ in range(num_tensors):
            name = cursor.strings(1)[0]
            dims = [cursor.scalar("<Q") for _ in range(cursor.scalar("<I"))]
            infos.append((name, tuple(reversed(dims)), cursor.scalar("<I"), cursor.scalar("<Q")))
        alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-cursor.pos // alignment) * alignment
    tensors = {
        name: GGUFTensorInfo(name, shape, ggml_type, data_start + offset)
        for name, shape, ggml_type, offset in infos
    }
    return GGUFHeader(path=path, version=version, metadata=metadata, tensors=tensors)


def read_gguf_raw(file: BinaryIO, info: GGUFTensorInfo, path: str) -> tuple[np.ndarray, str]:
    """One tensor's bytes exactly as stored (uint8) and its GGML type name (``"Q4_1"``).

    Reads with a plain ``readinto`` (no memory map), so the bytes of tensors already
    loaded do not stay resident.
    """
    import gguf

    try:
        qtype = gguf.GGMLQuantizationType(info.ggml_type)
    except ValueError:
        raise ValueError(
            f"{path}: tensor {info.name} has GGML type {info.ggml_type}, which the installed "
            "gguf package does not know; upgrade gguf or re-quantize the file."
        ) from None
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    num_elements = int(np.prod(info.shape))
    if num_elements % block_size:
        raise ValueError(
            f"{path}: tensor {info.name} is not a whole number of {qtype.name} blocks."
        )
    raw = np.empty(num_elements // block_size * type_size, dtype=np.uint8)
    file.seek(info.offset)
    if file.readinto(memoryview(raw)) != raw.size:
        raise ValueError(
            f"{path} is truncated (tensor {info.name} runs past the end); download it again."
        )
    return raw, qtype.name


def read_gguf_tensor(file: BinaryIO, info: GGUFTensorInfo, path: str) -> torch.Tensor:
    """One tensor as float32 in HF shape, dequantized from any type ``gguf`` understands.

    Loading peaks at the model plus about two float32 copies of the largest tensor.
    """
    raw, type_name = read_gguf_raw(file, info, path)
    return dequantize_gguf_raw(raw, type_name, info, path)


def dequantize_gguf_raw(
    raw: np.ndarray, type_name: str, info: GGUFTensorInfo, path: str
) -> torch.Tensor:
    """``read_gguf_raw``'s bytes as float32 in HF shape.

    Types with an affine block form (``gguf_blocks``) are decoded with torch, several times
    faster than ``gguf.dequantize``'s numpy loops over rows and bit-for-bit the same values
    (``tests/loader/test_gguf_blocks.py``); every other type goes through ``gguf``.
    """
    import gguf

    from pagedlm.model_executor.loader.gguf_blocks import AFFINE_TYPES, decode_blocks

    qtype = gguf.GGMLQuantizationType[type_name]
    if qtype == gguf.GGMLQuantizationType.F32:
        return torch.from_numpy(raw.view(np.float32).reshape(info.shape))
    if type_name in AFFINE_TYPES:
        rows_by_cols = (int(np.prod(info.shape[:-1])), info.shape[-1])
        blocks = decode_blocks(raw, type_name, rows_by_cols, groups_of_16=True)
        if blocks is not None:
            return blocks.dequantize().reshape(info.shape)
    byte_shape = gguf.quant_shape_to_byte_shape(info.shape, qtype)
    try:
        values = gguf.dequantize(raw.reshape(byte_shape), qtype)
    except NotImplementedError:
        raise ValueError(
            f"{path}: tensor {info.name} uses GGML type {qtype.name}, which pagedlm cannot "
            "dequantize (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K-Q6_K and "
            "the other types gguf.dequantize handles); re-quantize the file with another type."
        ) from None
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(info.shape))
