"""GGUF weights kept quantized on the GPU: their device layout, the code-to-float step the
GGUF kernels share (``slot_codes``), the tile dequantizer and the batch-1 GEMV.

A layer's weight ``w[r, c] = scale[r, c // g] * code[r, c] + min[r, c // g]`` (the loader's
affine form, ``gguf_blocks.AffineBlocks``) is stored as ``PackedGguf``:

- codes in int32 words, ``32 / bits`` codes per word: 4 bits for codes below 16 (Q4_0,
  Q4_1, Q4_K; 8 per word), else 8 (Q5_*, Q8_0; 4 per word). Eight consecutive words
  form a *lane group* of ``SPAN = 8 * codes_per_word`` columns (64 or 32): code slot
  ``i`` of word ``w`` in group ``g`` holds column ``SPAN * g + 8 * i + w``. So one slot
  across a group's eight words is eight adjacent columns (one vector load of x), and each
  32-column scale group is four whole slots (4-bit codes: slots 0-3 and 4-7 of a group
  are its two scale groups; 8-bit: the group is one). Slot ``i`` sits in byte ``i % 4``
  of its word, in the high nibble for slots 4-7 (``slot_position``): one mask then leaves
  a scale group's four codes one per byte, as the int8 GEMV's ``dp4a`` takes them.
  Rows are padded with zero codes to whole groups; kernels read x as zero past K.
- scales ``[N, K / group]`` (``group``: 32 weights, or 16 for Q2_K, Q3_K and Q6_K: two
  slots) in float16 where every one is exact in float16 (the legacy types' ``d`` is a
  float16), else float32 (the K-quants' ``d * sub_scale`` needs up to 19 bits);
- minimums the same way, or none where each is ``-offset * scale`` (Q3_K: 4, Q4_0: 8,
  Q5_0: 16, Q6_K: 32, Q8_0: 128): the kernel then computes ``(code - offset) * scale``.

Q4_0 thus reads 0.5625 byte per weight (the file's own size), Q4_1 0.625 and Q4_K 0.75,
against 2 for bf16. Dequantized values equal the float32 ones exactly (same products and
one rounding, as in ``AffineBlocks.dequantize``); kernels accumulate in float32.

Codes become floats without a conversion instruction (NVIDIA GPUs convert integers at a
quarter of the FMA rate, which bounded the previous GEMV at 21-37% of the bandwidth,
session 14): a code masked in place at bit ``s`` of its word and OR-ed into the bits of the
float ``2^(23 - s)`` *is* the float ``2^(23 - s) + code``, and one subtraction leaves
``code - offset`` exactly (``_slot_products``). Per weight the GEMV spends one logic op,
one add and one FMA, plus per word a shift and an FMA per scale.

The GEMV gives each program ``BLOCK_N`` whole rows and streams them in slices of
``BLOCK_K`` columns (whole lane groups), accumulating per (row, word) and summing once at
the end. The words are loaded as rows of contiguous words, so a warp's threads spread
along a row and each thread holds the same few words of several rows: the x it loads
and converts serves all of them.

Instructions in the loop per weight (sm_90 SASS of the default tiles,
``tests/cuda/sass_gguf_gemv.py``, session 17): 4.70 for 4-bit codes and 4.72 for 8-bit,
none of them a conversion. Session 14's kernel (one byte per two codes, ``(code & 15)``
and ``code >> 4`` converted with ``I2F``) spent 7.3 per weight, one of them an ``I2F``
(a quarter-rate instruction), and ran at 21-37% of the bandwidth (0.95x bf16's tok/s in
W2). Timed on an H100 (session 18, ``tests/cuda/bench_gemv.py --kinds gguf4 --sweep``):
67-83% of its bandwidth on llama-3-8b's gate/up and LM head, 26-33% on q/k/v, o and down,
whose few one-warp programs leave it latency-bound; W2 on a Q4_0 file 1.48x bf16's tok/s
(``python -m pagedlm.benchmarks.quantized_gpu --parts gguf``).

Split-K (session 21, ``split_k.py``): with ``split_k`` > 1 each row block's slices are
shared by that many programs, and the last of them to finish adds their parts in a fixed
order. On an H100 it took the few-program projections from 26-33% toward half the
bandwidth (q/k/v 16.97 -> 9.96 us, down 32.61 -> 20.52) and W2 on a Q4_0 file from 280.1
to 347.7 tok/s (1.52x -> 1.89x bf16).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagedlm_cuda.kernels import pdl
from pagedlm_cuda.kernels.gemv import GemvConfig, gemv_config
from pagedlm_cuda.kernels.split_k import plan_split, split_sum

GROUP_SIZE = 32
LANES = tl.constexpr(8)
"""Words per lane group."""
MAGIC = tl.constexpr(0x4B000000)
"""The bits of the float 2^23: OR-ing an integer below 2^23 into them gives 2^23 + it."""


@dataclass(frozen=True)
class PackedGguf:
    """One layer's GGUF weight on the device (see the module docstring)."""

    codes: torch.Tensor
    """int32 [N, ceil(K / span) * 8]: ``32 / bits`` codes per word, in lane groups."""
    scales: torch.Tensor
    """float16 or float32 [N, K / group_size]."""
    mins: torch.Tensor | None
    """Like ``scales``, or None: each minimum is ``-offset * scale``."""
    offset: int
    bits: int
    in_features: int

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def group_size(self) -> int:
        """Weights per scale: 32, or 16 (Q2_K, Q3_K, Q6_K)."""
        return self.in_features // self.scales.shape[1]

    @property
    def span(self) -> int:
        """Columns per lane group: 64 (4-bit codes) or 32 (8-bit)."""
        return LANES.value * 32 // self.bits

    def nbytes(self) -> int:
        tensors = [self.codes, self.scales] + ([self.mins] if self.mins is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


def _exact_in_half(values: torch.Tensor) -> bool:
    return bool(torch.equal(values.half().float(), values))


def pack_words(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [N, K] (each below ``2 ** bits``) -> int32 words in lane groups
    (the module docstring's layout), K padded with zero codes to whole groups. Built as
    bytes (two 4-bit codes or one 8-bit code each) viewed as little-endian words, so no
    wider copy of the codes is made."""
    per_word = 32 // bits
    span = LANES.value * per_word
    rows, cols = codes.shape
    padded = F.pad(codes.to(torch.uint8), (0, -cols % span))
    slots = padded.view(rows, -1, per_word, LANES.value)  # [N, groups, slot, word]
    if bits == 4:  # byte b of a word: slot b in its low nibble, slot b + 4 in its high
        slots = slots[:, :, :4] | (slots[:, :, 4:] << 4)
    if sys.byteorder != "little":
        raise RuntimeError("pack_words builds words from bytes in little-endian order.")
    words = slots.transpose(2, 3).contiguous()  # [N, groups, word, byte]
    return words.view(torch.int32).reshape(rows, -1)


def pack_blocks(
    codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, device: torch.device
) -> PackedGguf:
    """The device layout of an affine tensor: codes uint8 [N, K], scales and mins float32
    [N, K / group] with a group of 32 or 16 columns (``AffineBlocks``' fields)."""
    cols = codes.shape[1]
    if cols % GROUP_SIZE:
        raise ValueError(f"GGUF weights need K a multiple of {GROUP_SIZE}; got {cols}.")
    group = cols // scales.shape[1]
    if group not in (16, 32) or scales.shape[1] * group != cols:
        raise ValueError(f"GGUF weights have a scale per 16 or 32 columns; got {group}.")
    bits = 4 if int(codes.max()) < 16 else 8
    offset = next((o for o in (4, 8, 16, 32, 128) if torch.equal(mins, -o * scales)), 0)
    stored_mins = None if offset else mins
    exact = _exact_in_half(scales) and (stored_mins is None or _exact_in_half(stored_mins))
    dtype = torch.float16 if exact else torch.float32
    return PackedGguf(
        codes=pack_words(codes.cpu(), bits).to(device),
        scales=scales.to(device, dtype).contiguous(),
        mins=None if stored_mins is None else stored_mins.to(device, dtype).contiguous(),
        offset=offset,
        bits=bits,
        in_features=cols,
    )


@triton.jit
def slot_position(slot):
    """The lowest bit of code slot ``slot`` (an int or an int tensor) in its word: byte
    ``slot % 4``, its high nibble for slots 4-7 (4-bit codes; 8-bit ones have slots 0-3)."""
    return 8 * (slot % 4) + 4 * (slot // 4)


@triton.jit
def slot_codes(words, magic, slot: tl.constexpr, OFFSET: tl.constexpr, BITS: tl.constexpr):
    """float32 ``code - OFFSET`` of each int32 word's code in ``slot``, exactly, without a
    conversion: masked in place (the upper half's codes first shifted down 12 bits, which
    keeps every one below 2^23 and no mask a bare low-bit field, which the compiler would
    extract with an extra instruction) at a shift ``s``, OR-ed into the bits of
    ``2^(23 - s)`` (``magic`` less ``s`` in the exponent; in a register, so that mask and
    OR are one ``LOP3``: an instruction holds one immediate), the code is the float
    ``2^(23 - s) + code``, and one subtraction leaves ``code - OFFSET``."""
    POSITION: tl.constexpr = 8 * (slot % 4) + 4 * (slot // 4)  # slot_position
    SHIFT: tl.constexpr = POSITION - 12 if POSITION >= 16 else POSITION
    MASK: tl.constexpr = (2**BITS - 1) * 2**SHIFT
    BIAS: tl.constexpr = 2.0 ** (23 - SHIFT) + OFFSET
    if POSITION >= 16:
        words = (words.to(tl.uint32, bitcast=True) >> 12).to(tl.int32, bitcast=True)
    return ((words & MASK) | (magic - SHIFT * 8388608)).to(tl.float32, bitcast=True) - BIAS


@triton.jit
def _slot_products(
    words, magic, x_ptr, columns, K, slot: tl.constexpr, OFFSET: tl.constexpr,
    BITS: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """Each word's code in ``slot`` (``slot_codes``) times its column of x (``columns``:
    slot 0's, [G, 8]), and that x: float32 [BLOCK_N, G, 8] and [G, 8]."""
    codes = slot_codes(words, magic, slot, OFFSET, BITS)
    cols = columns + 8 * slot
    if EVEN_K:
        x = tl.load(x_ptr + cols).to(tl.float32)
    else:
        x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    return codes * x[None], x


@triton.jit
def load_weight_tile(
    codes_ptr, scales_ptr, mins_ptr, rows, row_mask, k0, K, stride_codes, stride_groups,
    OFFSET: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_MINS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """float32 [BLOCK_N, BLOCK_K]: rows ``rows`` (masked by ``row_mask``), columns
    ``k0 ..`` of the weight (zeros past K); ``k0`` and ``BLOCK_K`` are multiples of the
    span (64 columns for 4-bit codes, 32 for 8-bit)."""
    PER_WORD: tl.constexpr = 32 // BITS
    SPAN: tl.constexpr = LANES * PER_WORD
    GROUPS: tl.constexpr = BLOCK_K // SPAN
    SCALES: tl.constexpr = BLOCK_K // GROUP
    lane_groups = k0 // SPAN + tl.arange(0, GROUPS)
    words_at = lane_groups[:, None] * LANES + tl.arange(0, LANES)[None, :]  # [GROUPS, 8]
    row_offsets = rows.to(tl.int64)[:, None, None] * stride_codes
    mask = row_mask[:, None, None] & (lane_groups * SPAN < K)[None, :, None]
    words = tl.load(codes_ptr + row_offsets + words_at[None, :, :], mask=mask, other=0)
    # [BLOCK_N, GROUPS, slot, word] is column order: column = SPAN * g + 8 * slot + word.
    shifts = slot_position(tl.arange(0, PER_WORD))[None, None, :, None]
    codes = (words[:, :, None, :] >> shifts) & ((1 << BITS) - 1)
    codes = (codes | MAGIC).to(tl.float32, bitcast=True) - 8388608.0
    codes = tl.reshape(codes, (BLOCK_N, SCALES, GROUP))
    groups = k0 // GROUP + tl.arange(0, SCALES)
    group_mask = row_mask[:, None] & (groups[None, :] < K // GROUP)
    group_offsets = rows.to(tl.int64)[:, None] * stride_groups + groups[None, :]
    scales = load_groups(scales_ptr + group_offsets, group_mask, False)
    if HAS_MINS:
        mins = load_groups(mins_ptr + group_offsets, group_mask, False)
    else:
        mins = scales * -OFFSET  # exact: OFFSET is a power of two
    weights = codes * scales[:, :, None] + mins[:, :, None]
    return tl.reshape(weights, (BLOCK_N, BLOCK_K))


@triton.jit
def load_groups(pointers, mask, EVEN: tl.constexpr):
    """float32 scales or minimums; ``mask`` applies unless ``EVEN``."""
    if EVEN:
        return tl.load(pointers).to(tl.float32)
    return tl.load(pointers, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _slice_products(
    words, magic, x_ptr, scales_ptr, mins_ptr, rows, row_mask, g0, K, stride_groups,
    OFFSET: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_MINS: tl.constexpr,
    BLOCK_G: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, EMULATE: tl.constexpr,
):  # fmt: skip
    """``gemv_kernel``'s ``SLICE`` for float products. float32 [BLOCK_N, BLOCK_G, 8]: per
    (row, word) of the slice's ``words`` (lane groups ``g0 ..``), the sum of its weights
    times x. (``EMULATE`` is the int8 slice's.)"""
    PER_WORD: tl.constexpr = 32 // BITS
    SPAN: tl.constexpr = LANES * PER_WORD
    SLOTS_PER_SCALE: tl.constexpr = GROUP // LANES  # four (or two) slots of eight columns
    SCALES_PER_SPAN: tl.constexpr = PER_WORD // SLOTS_PER_SCALE
    lane_groups = g0 + tl.arange(0, BLOCK_G)
    columns = lane_groups[:, None] * SPAN + tl.arange(0, LANES)[None, :]  # slot 0, [G, 8]
    row_groups = rows.to(tl.int64)[:, None] * stride_groups
    out = tl.zeros(words.shape, dtype=tl.float32)
    for part in tl.static_range(SCALES_PER_SPAN):  # the scale groups in a span
        groups = lane_groups * SCALES_PER_SPAN + part
        at = row_groups + groups[None, :]
        group_mask = row_mask[:, None] & (groups[None, :] < K // GROUP)
        scale = load_groups(scales_ptr + at, group_mask, EVEN_N and EVEN_K)
        dot = tl.zeros(words.shape, dtype=tl.float32)
        x_sum = tl.zeros(columns.shape, dtype=tl.float32)
        for j in tl.static_range(SLOTS_PER_SCALE):
            products, x = _slot_products(
                words, magic, x_ptr, columns, K, part * SLOTS_PER_SCALE + j, OFFSET, BITS,
                EVEN_K,
            )  # fmt: skip
            dot += products
            if HAS_MINS:
                x_sum += x
        out += dot * scale[:, :, None]
        if HAS_MINS:
            low = load_groups(mins_ptr + at, group_mask, EVEN_N and EVEN_K)
            out += low[:, :, None] * x_sum[None]
    return out


@triton.jit
def gemv_kernel(
    x_ptr, codes_ptr, scales_ptr, mins_ptr, bias_ptr, out_ptr, partials_ptr, counts_ptr, N, K,
    stride_codes, stride_groups, magic, CHUNK_G,
    SLICE: tl.constexpr, OFFSET: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
    HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
    PIPELINE: tl.constexpr, SPLIT: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    EMULATE: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """The batch-1 GEMV's programs and slices, around ``SLICE``: a jitted function of
    ``_slice_products``' arguments that returns float32 [BLOCK_N, BLOCK_G(, 8)], each row's
    part of the product over a slice, summed over all but the rows at the end
    (``_slice_products``, or the int8 GEMV's ``_slice_terms``).
    ``EVEN_N``: N is a multiple of BLOCK_N; ``EVEN_K``: K is a multiple of BLOCK_G lane
    groups (no masks then). ``SPLIT`` > 1: program (i, s) takes lane groups ``s * CHUNK_G``
    on (``CHUNK_G`` a multiple of BLOCK_G) of row block i (``split_k.py``)."""
    pdl.allow_next(USE_PDL)
    SPAN: tl.constexpr = LANES * (32 // BITS)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    n_groups = tl.cdiv(K, SPAN)
    if SPLIT > 1:
        g_start = tl.program_id(1) * CHUNK_G
        g_end = tl.minimum(g_start + CHUNK_G, n_groups)
    else:
        g_start = 0
        g_end = n_groups
    # Loaded as rows of contiguous words (so threads spread along a row and each holds
    # several rows: its x is reused), then viewed as [rows, lane groups, 8].
    BLOCK_W: tl.constexpr = BLOCK_G * LANES
    word_ids = tl.arange(0, BLOCK_W)
    row_words = codes_ptr + rows.to(tl.int64)[:, None] * stride_codes + word_ids[None, :]
    # Weights never change: the first slice is read before waiting for x's producer.
    if EVEN_N and EVEN_K:
        words = tl.load(row_words + g_start * LANES)
    else:
        mask = row_mask[:, None] & (g_start * LANES + word_ids[None, :] < n_groups * LANES)
        words = tl.load(row_words + g_start * LANES, mask=mask, other=0)
    pdl.wait_for_previous(USE_PDL)
    acc = SLICE(
        tl.reshape(words, (BLOCK_N, BLOCK_G, LANES)), magic, x_ptr, scales_ptr, mins_ptr,
        rows, row_mask, g_start, K, stride_groups, OFFSET, BITS, GROUP, HAS_MINS, BLOCK_G,
        EVEN_N, EVEN_K, EMULATE,
    )  # fmt: skip
    # PIPELINE > 1 keeps that many slices in flight (as in ``gemv``).
    for g0 in tl.range(g_start + BLOCK_G, g_end, BLOCK_G, num_stages=PIPELINE):
        if EVEN_N and EVEN_K:
            words = tl.load(row_words + g0 * LANES)
        else:
            mask = row_mask[:, None] & (g0 * LANES + word_ids[None, :] < n_groups * LANES)
            words = tl.load(row_words + g0 * LANES, mask=mask, other=0)
        acc += SLICE(
            tl.reshape(words, (BLOCK_N, BLOCK_G, LANES)), magic, x_ptr, scales_ptr, mins_ptr,
            rows, row_mask, g0, K, stride_groups, OFFSET, BITS, GROUP, HAS_MINS, BLOCK_G,
            EVEN_N, EVEN_K, EMULATE,
        )  # fmt: skip
    if len(acc.shape) == 3:
        acc = tl.sum(acc, axis=2)
    y = tl.sum(acc, axis=1)
    if SPLIT > 1:
        last, y = split_sum(y, rows, row_mask, partials_ptr, counts_ptr, N, SPLIT)
        if last:
            _store_rows(y, rows, row_mask, bias_ptr, out_ptr, HAS_BIAS)
    else:
        _store_rows(y, rows, row_mask, bias_ptr, out_ptr, HAS_BIAS)


@triton.jit
def _store_rows(y, rows, row_mask, bias_ptr, out_ptr, HAS_BIAS: tl.constexpr):
    """Add the bias to the float32 sums ``y`` of ``rows`` and store them in out's dtype."""
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)


def default_gemv_config(weight: PackedGguf, int8: bool = False, half: bool = False) -> GemvConfig:
    """``gemv.gemv_config`` for the weight's kind (``gguf4`` / ``gguf8``; with ``int8``,
    ``gguf4i8`` / ``gguf8i8``: the int8 GEMV's tiles; with ``half``, ``gguf4h``: the
    float16-product GEMV's)."""
    kind = ("gguf4" if weight.bits == 4 else "gguf8") + ("i8" if int8 else "h" if half else "")
    return gemv_config(weight.out_features, weight.in_features, kind)


def gguf_gemv(
    x: torch.Tensor,
    weight: PackedGguf,
    bias: torch.Tensor | None = None,
    config: GemvConfig | tuple[int, ...] | None = None,
) -> torch.Tensor:
    """x [1, K] (unit-stride row) -> [1, N] in x's dtype. ``config``: (block_n, block_k,
    num_warps[, pipeline_stages]) with ``block_k`` a power-of-two multiple of the span."""
    cfg = default_gemv_config(weight) if config is None else GemvConfig(*config)
    return launch_gemv("gguf_gemv", _slice_products, x, weight, bias, cfg)


def launch_gemv(
    name: str,
    slice_fn: triton.JITFunction,
    x: torch.Tensor,
    weight: PackedGguf,
    bias: torch.Tensor | None,
    config: GemvConfig,
) -> torch.Tensor:
    """``gemv_kernel`` with ``slice_fn`` as its ``SLICE``, after checking the arguments
    (``name`` is the public function's, for the errors)."""
    if x.dim() != 2 or x.shape[0] != 1 or x.stride(1) != 1:
        raise ValueError(f"{name} takes one unit-stride row [1, K]; got {tuple(x.shape)}.")
    n, k = weight.out_features, weight.in_features
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features but the weight is [{n}, {k}].")
    block_g = config.block_k // weight.span
    if config.block_k % weight.span or block_g & (block_g - 1):
        raise ValueError(
            f"{name} streams a power of two of whole {weight.span}-column lane groups; "
            f"got {config}."
        )
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    mins = weight.mins if weight.mins is not None else weight.scales
    num_slices = triton.cdiv(triton.cdiv(k, weight.span), block_g)
    split, per_split, partials, counts = plan_split(
        name, n, config.block_n, num_slices, config.split_k, x.device
    )
    gemv_kernel[(triton.cdiv(n, config.block_n), split)](
        x, weight.codes, weight.scales, mins, bias if bias is not None else weight.scales,
        out, partials if partials is not None else out, counts if counts is not None else out,
        n, k, weight.codes.stride(0), weight.scales.stride(0),
        MAGIC.value, per_split * block_g if split > 1 else 0,  # one variant per kernel
        SLICE=slice_fn, OFFSET=weight.offset, BITS=weight.bits, GROUP=weight.group_size,
        HAS_MINS=weight.mins is not None, HAS_BIAS=bias is not None,
        BLOCK_N=config.block_n, BLOCK_G=block_g, PIPELINE=config.pipeline_stages, SPLIT=split,
        EVEN_N=n % config.block_n == 0, EVEN_K=k % config.block_k == 0,
        EMULATE=os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=config.num_warps, num_stages=config.pipeline_stages, **pdl.launch_options(),
    )  # fmt: skip
    return out
