"""GGUF block quantization in affine form: integer codes, and a scale and a minimum per
group of 32 (or 16) weights.

Every type handled here stores a tensor row as blocks of 32 weights (or super-blocks of 256
made of eight 32-weight sub-blocks) whose values are ``scale * code + minimum`` with one
``scale`` and one ``minimum`` per 32 weights and an unsigned integer ``code``:

| type | code bits | scale | minimum |
| --- | --- | --- | --- |
| Q4_0 | 4 | d | -8 d |
| Q4_1 | 4 | d | m |
| Q5_0 | 5 | d | -16 d |
| Q5_1 | 5 | d | m |
| Q8_0 | 8 (the int8 value + 128) | d | -128 d |
| Q4_K | 4 | d * sc[j] | -dmin * m[j] |
| Q5_K | 5 | d * sc[j] | -dmin * m[j] |
| Q2_K (groups of 16) | 2 | d * (sc[j] & 15) | -dmin * (sc[j] >> 4) |
| Q3_K (groups of 16) | 3 (the 2 low bits + 4 * the high bit) | d * (sc[j] - 32) | -4 d * (sc[j] - 32) |
| Q6_K (groups of 16) | 6 | d * sc[j] (sc signed) | -32 d * sc[j] |

That is the form weight-only quantized matmul kernels take (torch's int4 kernels compute
``(code - 8) * scale + zero`` per group of 32), so a kernel can use the file's own codes
instead of re-quantizing dequantized weights. ``scale * code + minimum`` in float32 gives
exactly what ``gguf.dequantize`` gives: every product is exact in float32 (an 11-bit float16
scale, or a float16 times a 6-bit sub-scale, times a code of at most 8 bits), and the one
addition rounds the same way (Q6_K: a float16 times an 8-bit sub-scale times a 6-bit
code). Q2_K's, Q3_K's and Q6_K's groups are 16 weights, which not every kernel takes
(torch's CPU int4 kernel needs 32 or more): ``decode_blocks`` gives their form only to a
caller that accepts groups of 16. The non-affine types (IQ*) have no such form:
``decode_blocks`` returns None.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

GROUP_SIZE = 32
"""Weights sharing one scale and one minimum (16 for Q2_K, Q3_K and Q6_K, where a caller
accepts it)."""


@dataclass(frozen=True)
class AffineBlocks:
    """``w[r, c] = scales[r, c // g] * codes[r, c] + mins[r, c // g]`` for a [rows, cols]
    tensor, ``g = group_size`` (32, or 16 for Q2_K, Q3_K and Q6_K)."""

    codes: torch.Tensor
    """uint8 [rows, cols]."""
    scales: torch.Tensor
    """float32 [rows, cols // group_size]."""
    mins: torch.Tensor
    """float32 [rows, cols // group_size]."""

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] // max(1, self.scales.shape[1])

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols]: the values these blocks stand for."""
        rows, cols = self.codes.shape
        grouped = self.codes.view(rows, -1, self.group_size).float()
        # In place: one float32 buffer, the same two roundings as ``codes * scale + min``.
        return grouped.mul_(self.scales[..., None]).add_(self.mins[..., None]).view(rows, cols)


_Decoded = tuple[np.ndarray, np.ndarray, np.ndarray]
"""(codes [blocks, elements], scales and mins [blocks, elements // group]), per block."""


def _f16(raw: np.ndarray) -> np.ndarray:
    """Two bytes per block as float16 -> float32 [blocks, 1]."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, groups: int) -> np.ndarray:
    """[blocks, groups * 16] bytes -> [blocks, groups * 32] codes: in each run of 16 bytes
    the low nibbles are elements 0..15 and the high nibbles elements 16..31."""
    codes = np.empty((qs.shape[0], groups, 2, 16), np.uint8)
    grouped = qs.reshape(qs.shape[0], groups, 16)
    np.bitwise_and(grouped, 0x0F, out=codes[:, :, 0])
    np.right_shift(grouped, 4, out=codes[:, :, 1])
    return codes.reshape(qs.shape[0], -1)


def _high_bits_32(qh: np.ndarray) -> np.ndarray:
    """[blocks, 4] bytes (a little-endian uint32) -> [blocks, 32] bit i as 0 or 16."""
    bits = np.ascontiguousarray(qh).view(np.uint32) >> np.arange(32, dtype=np.uint32)
    return ((bits & 1) << 4).astype(np.uint8)


def _q4_0(blocks: np.ndarray) -> _Decoded:
    d = _f16(blocks[:, :2])
    return _nibbles(blocks[:, 2:], 1), d, -8 * d


def _q4_1(blocks: np.ndarray) -> _Decoded:
    return _nibbles(blocks[:, 4:], 1), _f16(blocks[:, :2]), _f16(blocks[:, 2:4])


def _q5_0(blocks: np.ndarray) -> _Decoded:
    d = _f16(blocks[:, :2])
    return _nibbles(blocks[:, 6:], 1) | _high_bits_32(blocks[:, 2:6]), d, -16 * d


def _q5_1(blocks: np.ndarray) -> _Decoded:
    codes = _nibbles(blocks[:, 8:], 1) | _high_bits_32(blocks[:, 4:8])
    return codes, _f16(blocks[:, :2]), _f16(blocks[:, 2:4])


def _q8_0(blocks: np.ndarray) -> _Decoded:
    d = _f16(blocks[:, :2])
    # int8 q + 128 is q's byte with the top bit flipped.
    return blocks[:, 2:] ^ np.uint8(0x80), d, -128 * d


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K super-block header -> per-sub-block scale and minimum [blocks, 8]."""
    import gguf

    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sub_scales, sub_mins = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    sub_scales = sub_scales.reshape(blocks.shape[0], 8).astype(np.float32)
    sub_mins = sub_mins.reshape(blocks.shape[0], 8).astype(np.float32)
    return d * sub_scales, -(dmin * sub_mins)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """[blocks, 128] -> [blocks, 256]: each 32 bytes hold sub-block 2c in their low nibbles
    and 2c + 1 in their high nibbles."""
    split = qs.reshape(qs.shape[0], 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
    return (split & 0x0F).reshape(qs.shape[0], -1)


def _q4_k(blocks: np.ndarray) -> _Decoded:
    scales, mins = _k_scales(blocks)
    return _k_nibbles(blocks[:, 16:]), scales, mins


def _q5_k(blocks: np.ndarray) -> _Decoded:
    scales, mins = _k_scales(blocks)
    # Bit j of qh[l] is the fifth bit of element l of sub-block j.
    qh = blocks[:, 16:48].reshape(blocks.shape[0], 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]
    high = ((qh & 1) << 4).reshape(blocks.shape[0], -1)
    return _k_nibbles(blocks[:, 48:]) | high, scales, mins


def _q6_k(blocks: np.ndarray) -> _Decoded:
    """Element ``128 n + 32 k + l`` of a super-block: low 4 bits from ``ql[64 n + 32 (k % 2)
    + l]`` (the high nibble for k >= 2), high 2 bits from ``qh[32 n + l]`` bits ``2 k``;
    scale group ``e // 16``."""
    count = blocks.shape[0]
    ql = blocks[:, :128].reshape(count, 2, 1, 2, 32)  # [block, n, -, k % 2, l]
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(count, 2, 4, 32)
    qh = blocks[:, 128:192].reshape(count, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]
    codes = (low | ((qh & 3) << 4)).reshape(count, 256)
    d = _f16(blocks[:, 208:210])
    scales = d * np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    return codes, scales, -32 * scales


_DECODERS: dict[str, Callable[[np.ndarray], _Decoded]] = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
}


def _two_bit_fields(packed: np.ndarray) -> np.ndarray:
    """[blocks, 64] bytes -> [blocks, 256] 2-bit fields: element ``128 n + 32 k + l`` is
    bits ``2 k`` of byte ``32 n + l`` (Q2_K's and Q3_K's low bits)."""
    shifts = (2 * np.arange(4, dtype=np.uint8))[:, None]
    return ((packed.reshape(packed.shape[0], 2, 1, 32) >> shifts) & 3).reshape(packed.shape[0], -1)


def _q2_k(blocks: np.ndarray) -> _Decoded:
    sub = blocks[:, :16]
    d, dmin = _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
    scales = d * (sub & 0x0F).astype(np.float32)
    return _two_bit_fields(blocks[:, 16:80]), scales, -(dmin * (sub >> 4).astype(np.float32))


def _q3_k(blocks: np.ndarray) -> _Decoded:
    """Codes ``low + 4 * high``: gguf's value (``low``, less 4 where the high bit is clear)
    plus 4. 6-bit sub-scales less 32, their low nibbles in bytes 96-103 (sub-scale ``j`` in byte
    ``j % 8``, high nibble for j >= 8), their high 2 bits in bytes 104-107 (bits
    ``2 (j // 4)`` of byte ``j % 4``)."""
    count = blocks.shape[0]
    high = (blocks[:, :32].reshape(count, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    codes = _two_bit_fields(blocks[:, 32:96]) | (high.reshape(count, -1) << 2)
    low_nibbles = blocks[:, 96:104].reshape(count, 1, 8) >> np.array([0, 4], np.uint8)[:, None]
    top_bits = (
        blocks[:, 104:108].reshape(count, 1, 4) >> (2 * np.arange(4, dtype=np.uint8))[:, None]
    )
    sub = (low_nibbles.reshape(count, 16) & 0x0F) | ((top_bits.reshape(count, 16) & 3) << 4)
    scales = _f16(blocks[:, 108:110]) * (sub.astype(np.float32) - 32)
    return codes, scales, -4 * scales


_GROUPS_OF_16: dict[str, Callable[[np.ndarray], _Decoded]] = {
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "Q6_K": _q6_k,
}
AFFINE_TYPES = tuple(_DECODERS) + tuple(_GROUPS_OF_16)
"""GGUF types with an affine form (groups of 32; Q2_K's, Q3_K's and Q6_K's of 16)."""


def decode_blocks(
    raw: np.ndarray, type_name: str, shape: tuple[int, int], groups_of_16: bool = False
) -> AffineBlocks | None:
    """The affine form of one tensor's bytes (``raw``: uint8, the tensor's data in file
    order), or None when ``type_name`` has none (or has groups of 16 and ``groups_of_16``
    is False). ``shape``: [rows, cols] in HF order."""
    decoder = _DECODERS.get(type_name)
    if decoder is None and groups_of_16:
        decoder = _GROUPS_OF_16.get(type_name)
    if decoder is None:
        return None
    import gguf

    rows, cols = shape
    _, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    codes, scales, mins = decoder(raw.reshape(-1, type_size))
    return AffineBlocks(
        codes=torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, cols)),
        scales=torch.from_numpy(np.ascontiguousarray(scales, np.float32).reshape(rows, -1)),
        mins=torch.from_numpy(np.ascontiguousarray(mins, np.float32).reshape(rows, -1)),
    )
