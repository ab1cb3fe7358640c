"""A checkpoint tensor not read yet, so that a tensor-parallel rank reads only its slice.

``SafetensorsSlice`` knows a tensor's place in its file. ``narrow``, ``split``, ``chunk``
and ``[a:b]`` on the first dimension return smaller slices without reading; any other use
(``copy_`` into a parameter, an arithmetic operation, a method such as ``.t()``) reads the
slice's bytes and works on a plain tensor. The layers' weight loaders narrow before they copy
(``weight_utils.shard_of``), so a column-parallel weight reads its output rows, a
row-parallel one its input columns, a vocabulary its rows, a fused qkv / gate_up each
part's rows, and a MoE layer under expert parallelism never touches another rank's
experts; a model whose ``load_weights`` transforms a tensor first reads it whole, as before.

Invariant: a slice is a box (one contiguous index range per dimension) of a C-ordered
tensor; it is read as runs of consecutive bytes, one per index of the dimensions before the
last narrowed one, each with ``os.preadv`` straight into the result's buffer.
"""

from __future__ import annotations

import itertools
import math
import mmap
import os
from typing import Any

import torch

OWN_MAPPING_BYTES = 1 << 20
"""Read buffers this large get an anonymous mapping of their own."""


def read_buffer(nbytes: int) -> mmap.mmap | bytearray:
    """A buffer to read ``nbytes`` of a tensor into. Large tensors get their own anonymous
    mapping, unmapped as soon as the tensor is freed: through malloc, glibc's adaptive
    thresholds would keep up to 64 MB of freed read buffers resident for the rest of the
    load (measured: +29% on a 59 MB model)."""
    return mmap.mmap(-1, nbytes) if nbytes >= OWN_MAPPING_BYTES else bytearray(nbytes)


class SafetensorsSlice:
    """A box of the tensor at ``[begin, ...)`` of ``path``: ``starts[d] .. starts[d] +
    shape[d]`` of each dimension ``d`` of a tensor of ``full_shape``."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        name: str,
        dtype: torch.dtype,
        begin: int,
        full_shape: tuple[int, ...],
        starts: tuple[int, ...] | None = None,
        shape: tuple[int, ...] | None = None,
    ) -> None:
        self.path, self.name, self.dtype, self.begin = path, name, dtype, begin
        self.full_shape = full_shape
        self.starts = starts or (0,) * len(full_shape)
        self.shape = torch.Size(full_shape if shape is None else shape)

    # ---- what a weight loader asks without reading --------------------------------

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return math.prod(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def narrow(self, dim: int, start: int, length: int) -> SafetensorsSlice:
        dim = dim % self.dim()
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise IndexError(
                f"narrow({dim}, {start}, {length}) is outside {self.name} of shape "
                f"{tuple(self.shape)}"
            )
        starts, shape = list(self.starts), list(self.shape)
        starts[dim] += start
        shape[dim] = length
        return SafetensorsSlice(
            self.path,
            self.name,
            self.dtype,
            self.begin,
            self.full_shape,
            tuple(starts),
            tuple(shape),
        )

    def split(self, split_size: int | list[int], dim: int = 0) -> tuple[SafetensorsSlice, ...]:
        """``torch.split`` without reading (fused checkpoint tensors: Phi-3's qkv)."""
        total = self.shape[dim]
        if isinstance(split_size, int):
            sizes = [min(split_size, total - start) for start in range(0, total, split_size)]
        else:
            sizes = list(split_size)
        if sum(sizes) != total:
            raise ValueError(f"split sizes {sizes} do not add up to {total} rows of {self.name}")
        starts = itertools.accumulate(sizes, initial=0)
        return tuple(self.narrow(dim, start, size) for start, size in zip(starts, sizes))

    def chunk(self, chunks: int, dim: int = 0) -> tuple[SafetensorsSlice, ...]:
        return self.split(-(-self.shape[dim] // chunks), dim)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice) and index.step in (None, 1) and self.dim():
            start, stop, _ = index.indices(self.shape[0])
            return self.narrow(0, start, max(stop - start, 0))
        return self.materialize()[index]

    # ---- reading --------------------------------------------------------------------

    def materialize(self) -> torch.Tensor:
        """The slice's values, read from the file (a CPU tensor in the file's dtype)."""
        element = torch.empty(0, dtype=self.dtype).element_size()
        nbytes = self.numel() * element
        if not nbytes:
            return torch.empty(self.shape, dtype=self.dtype)
        buffer = read_buffer(nbytes)
        self._read_into(memoryview(buffer), element)
        return torch.frombuffer(buffer, dtype=torch.uint8).view(self.dtype).reshape(self.shape)

    def _read_into(self, out: memoryview, element: int) -> None:
        full, starts, shape = self.full_shape, self.starts, self.shape
        narrowed = [d for d in range(len(full)) if shape[d] != full[d]]
        last = narrowed[-1] if narrowed else 0
        strides = [math.prod(full[d + 1 :]) for d in range(len(full))]
        run = (shape[last] * strides[last] if full else 1) * element
        outer = [range(starts[d], starts[d] + shape[d]) for d in range(last)]
        first = (starts[last] * strides[last] if full else 0) * element
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for position, index in enumerate(itertools.product(*outer)):
                offset = self.begin + first + element * sum(i * s for i, s in zip(index, strides))
                target = out[position * run : (position + 1) * run]
                if os.preadv(fd, [target], offset) != run:
                    raise ValueError(
                        f"{self.path} ended inside tensor {self.name}; download it again."
                    )
        finally:
            os.close(fd)

    # ---- everything else reads the slice first --------------------------------------

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return func(*_materialized(args), **_materialized(kwargs or {}))

    def __getattr__(self, name: str) -> Any:
        # Only called for what the class does not define: tensor methods and attributes.
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.materialize(), name)

    def __repr__(self) -> str:
        return f"SafetensorsSlice({self.name}, shape={tuple(self.shape)}, dtype={self.dtype})"


def _delegate(name: str) -> Any:
    def method(self: SafetensorsSlice, *args: Any) -> Any:
        return getattr(self.materialize(), name)(*_materialized(args))

    method.__name__ = name
    return method


# Operators bypass __getattr__; a model's load_weights may compute with a tensor (x + 1).
for _name in (
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
    "__rtruediv__", "__pow__", "__neg__", "__matmul__", "__rmatmul__", "__array__",
):  # fmt: skip
    setattr(SafetensorsSlice, _name, _delegate(_name))


def _materialized(value: Any) -> Any:
    if isinstance(value, SafetensorsSlice):
        return value.materialize()
    if isinstance(value, (list, tuple)):
        return type(value)(_materialized(item) for item in value)
    if isinstance(value, dict):
        return {key: _materialized(item) for key, item in value.items()}
    return value
