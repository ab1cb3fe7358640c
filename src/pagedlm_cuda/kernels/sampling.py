"""Fused random sampling: temperature, Gumbel noise and argmax in one pass over the logits.

The sampler's exponential race ``argmax(probs / E)`` with ``E ~ Exp(1)`` is the Gumbel-max
trick in another form: ``log(probs / E) = logits / T - logsumexp - log(E)`` and
``-log(E) = -log(-log(U))`` is Gumbel noise, so the drawn token is
``argmax(logits / T + G)``, which needs neither the softmax nor a float32 copy of the
logits. Done with torch ops the race reads and writes ``[N, vocab]`` float32 about ten
times per step (cast, divide, softmax, noise, clamp, divide, argmax); here each program
reads one slice of one row once, draws its uniforms with Triton's counter-based Philox
(``tl.randint4x``: four draws per call, since Philox rounds would otherwise dominate), and
writes its best (value, index); a tiny second pass picks each row's winner. Greedy rows
(``noise_scale`` 0) take the plain argmax of their logits; an all-greedy batch (``seed``
None) draws no noise at all, which makes this a split argmax (at batch 1 over a 128k
vocabulary it replaces torch's single-block argmax, 27 us on the H200).

Random streams: the noise depends on ``seed`` (drawn from the engine's default generator
each step, on the device) and on the (row, token) position only, so a row's draw is a
deterministic function of the step's seed. Rows with their own seeded generator are not
sampled here (the torch path keeps their per-request streams).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from pagedlm_cuda.kernels import pdl

BLOCK_V = 2048
"""Vocabulary entries per loop iteration of one program."""
SPLIT_V = 16384
"""The most vocabulary entries per program (``split_width``)."""
MIN_PROGRAMS = 256
"""Programs a launch should have before its rows' splits grow (about two per SM)."""
LN2 = tl.constexpr(0.6931471805599453)
LOG2E = 1.4426950408889634
C1, C2, C3, C4, C5 = (tl.constexpr(LOG2E / k) for k in range(1, 6))
"""``-log2(1 - v) = LOG2E * (v + v^2/2 + v^3/3 + ...)``: the first five terms'
coefficients (the sixth is below float32's resolution for ``v < SERIES_BELOW``)."""
HALF_ULP_BELOW_ONE = tl.constexpr(1.0 - 2.0**-24)
SERIES_BELOW = tl.constexpr(0.03125)
"""``v = 1 - u`` under which ``-log2(u)`` comes from its series (``_log2_gumbel``)."""


def split_width(num_rows: int, vocab_size: int) -> int:
    """Vocabulary entries per program: ``BLOCK_V``, doubled up to ``SPLIT_V`` while the
    launch keeps ``MIN_PROGRAMS``. At batch 1 over a 128k vocabulary that is 63 programs
    of one iteration each, where ``SPLIT_V`` gave 8 programs of eight dependent
    iterations. The split changes neither the draws (a token's uniform depends on its
    position and ``BLOCK_V`` only) nor the winner (the first index among equal scores)."""
    split = BLOCK_V
    while split < SPLIT_V and num_rows * triton.cdiv(vocab_size, 2 * split) >= MIN_PROGRAMS:
        split *= 2
    return split


@functools.cache
def _fast_log() -> bool:
    """The hardware's approximate log2 (CUDA, compiled); the interpreter and other
    backends take ``tl.log2``."""
    return os.environ.get("TRITON_INTERPRET") != "1" and torch.version.hip is None


@triton.jit
def _log2(x, FAST: tl.constexpr):
    if FAST:
        return libdevice.fast_log2f(x)  # one MUFU.LG2; absolute error ~2^-22
    else:
        return tl.log2(x)


@triton.jit
def _uniform(bits):
    """A uniform in (0, 1) from 32 random bits: ``(k + 1/2) / 2^23`` for the top 23 bits
    ``k``, made by OR-ing them into the mantissa of 1.0 (no integer conversion), then one
    exact subtraction. Never 0 or 1, so no clamp; ``1 - u`` is exact from 1/2 up."""
    one_to_two = ((bits >> 9) | 0x3F800000).to(tl.float32, bitcast=True)  # [1, 2)
    return one_to_two - HALF_ULP_BELOW_ONE


@triton.jit
def _log2_gumbel(u, FAST: tl.constexpr):
    """``log2(-log2(u))`` of uniforms ``u`` in [0, 1): the Gumbel noise ``-log(-log(u))``
    is ``-LN2`` times it, plus the constant ``-log(LN2)``, which no row's argmax sees.

    The noise's absolute error is the relative error of ``-log2(u)``. The hardware's
    log2 has a small *absolute* error, so ``-log2(u)`` is taken from it only where it is
    not small (``u <= 1 - 1/32``: relative error below ~5e-6), and from its series in
    ``v = 1 - u`` (exact there) above: the draws near 1 are the large noises that let
    unlikely tokens win. libdevice's accurate ``log`` took about 20 instructions each; this
    takes two MUFU ops and a few FMAs (41 instructions per logit in the loop against 87,
    sm_90 SASS)."""
    v = 1.0 - u  # u in [2^-24, 1 - 2^-24] (``_uniform``): finite noise everywhere
    series = v * (C1 + v * (C2 + v * (C3 + v * (C4 + v * C5))))
    e = tl.where(v < SERIES_BELOW, series, -_log2(u, FAST))
    return _log2(e, FAST)


@triton.jit
def _race(
    best_value, best_index, row_ptr, cols, u, vocab_size, inv_temperature, noise_scale,
    HAS_NOISE: tl.constexpr, FAST_LOG: tl.constexpr,
):  # fmt: skip
    """Fold one slice of a row into the running (best score, its index) per lane."""
    mask = cols < vocab_size
    x = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
    score = x
    if HAS_NOISE:  # x / T + noise (up to the row's constant); noise_scale holds its -LN2
        score = x * inv_temperature + noise_scale * _log2_gumbel(u, FAST_LOG)
    score = tl.where(mask, score, float("-inf"))
    better = score > best_value  # strict: the earlier index wins ties, as torch.argmax
    return tl.where(better, score, best_value), tl.where(better, cols, best_index)


@triton.jit(do_not_specialize=["num_splits", "split_len"])
def _gumbel_argmax_kernel(
    logits_ptr, logits_stride, inv_temperature_ptr, noise_scale_ptr, seed_ptr,
    best_value_ptr, best_index_ptr, vocab_size, num_splits, split_len,
    HAS_TEMPERATURE: tl.constexpr, HAS_NOISE_SCALE: tl.constexpr, HAS_NOISE: tl.constexpr,
    BLOCK: tl.constexpr, FAST_LOG: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """``split_len`` is a runtime argument, and neither it nor ``num_splits`` is
    specialized (on 1 or a multiple of 16): either would compile a kernel for each batch
    size that changes ``split_width``, inside a serving run."""
    pdl.start(USE_PDL)
    row = tl.program_id(0)
    split = tl.program_id(1)
    inv_temperature = 1.0
    if HAS_TEMPERATURE:
        inv_temperature = tl.load(inv_temperature_ptr + row)
    noise_scale = -LN2
    if HAS_NOISE_SCALE:
        noise_scale = -LN2 * tl.load(noise_scale_ptr + row)
    seed = 0
    if HAS_NOISE:
        seed = tl.load(seed_ptr)
    row_ptr = logits_ptr + row.to(tl.int64) * logits_stride
    QUARTER: tl.constexpr = BLOCK // 4
    lanes = tl.arange(0, QUARTER)
    best_value = tl.full([QUARTER], float("-inf"), tl.float32)
    best_index = tl.zeros([QUARTER], tl.int32)
    # One Philox call yields four uniforms: counter c serves tokens 4c .. 4c + 3 of the
    # row's own counter range (rows never share counters). Offsets stay below 2**31 for
    # any batch x vocabulary this engine schedules.
    row_counter = row * ((vocab_size + 3) // 4)
    start = split * split_len
    for v0 in range(start, tl.minimum(start + split_len, vocab_size), BLOCK):
        if HAS_NOISE:
            b0, b1, b2, b3 = tl.randint4x(seed, row_counter + v0 // 4 + lanes)
            u0, u1, u2, u3 = _uniform(b0), _uniform(b1), _uniform(b2), _uniform(b3)
        else:
            u0 = lanes.to(tl.float32)  # unused without noise
            u1 = u0
            u2 = u0
            u3 = u0
        base = v0 + lanes
        best_value, best_index = _race(
            best_value, best_index, row_ptr, base, u0, vocab_size, inv_temperature,
            noise_scale, HAS_NOISE, FAST_LOG,
        )  # fmt: skip
        best_value, best_index = _race(
            best_value, best_index, row_ptr, base + QUARTER, u1, vocab_size,
            inv_temperature, noise_scale, HAS_NOISE, FAST_LOG,
        )  # fmt: skip
        best_value, best_index = _race(
            best_value, best_index, row_ptr, base + 2 * QUARTER, u2, vocab_size,
            inv_temperature, noise_scale, HAS_NOISE, FAST_LOG,
        )  # fmt: skip
        best_value, best_index = _race(
            best_value, best_index, row_ptr, base + 3 * QUARTER, u3, vocab_size,
            inv_temperature, noise_scale, HAS_NOISE, FAST_LOG,
        )  # fmt: skip
    top = tl.max(best_value, axis=0)
    # The lowest index among the lanes holding the maximum.
    index = tl.min(tl.where(best_value == top, best_index, 2147483647), axis=0)
    out = row * num_splits + split
    tl.store(best_value_ptr + out, top)
    tl.store(best_index_ptr + out, index)


@triton.jit(do_not_specialize=["num_splits"])
def _pick_kernel(
    best_value_ptr, best_index_ptr, token_ptr, num_splits,
    BLOCK_S: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """The second pass: a row's token is its best split's index, the first (lowest) among
    equal scores, as ``torch.argmax``. One launch where torch took three."""
    pdl.start(USE_PDL)
    row = tl.program_id(0)
    splits = tl.arange(0, BLOCK_S)
    mask = splits < num_splits
    at = row * num_splits + splits
    value = tl.load(best_value_ptr + at, mask=mask, other=float("-inf"))
    index = tl.load(best_index_ptr + at, mask=mask, other=2147483647)
    top = tl.max(value, axis=0)
    token = tl.min(tl.where(value == top, index, 2147483647), axis=0)
    tl.store(token_ptr + row, token.to(tl.int64))


def gumbel_partials(
    logits: torch.Tensor,
    temperature: torch.Tensor | None,
    noise_scale: torch.Tensor | None,
    seed: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first pass of ``gumbel_sample``: per row and split of the vocabulary
    (``split_width``), the best score and its (lowest) token index, ``[N, splits]``
    float32 and int32. A row's token is the index of its best split, the first among equal
    scores."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(
            f"logits must be [N, vocab] with a contiguous last dim, got {logits.shape}."
        )
    num_rows, vocab_size = logits.shape
    split = split_width(num_rows, vocab_size)
    num_splits = triton.cdiv(vocab_size, split)
    best_value = torch.empty((num_rows, num_splits), dtype=torch.float32, device=logits.device)
    best_index = torch.empty((num_rows, num_splits), dtype=torch.int32, device=logits.device)
    if num_rows == 0:
        return best_value, best_index
    inv_temperature = None if temperature is None else temperature.reciprocal()
    _gumbel_argmax_kernel[(num_rows, num_splits)](
        logits, logits.stride(0),
        inv_temperature if inv_temperature is not None else best_value,
        noise_scale if noise_scale is not None else best_value,
        seed if seed is not None else best_index, best_value, best_index, vocab_size, num_splits,
        split,  # positional, not a constexpr: see the kernel
        HAS_TEMPERATURE=inv_temperature is not None, HAS_NOISE_SCALE=noise_scale is not None,
        HAS_NOISE=seed is not None,
        BLOCK=max(16, min(BLOCK_V, triton.next_power_of_2(vocab_size))),
        FAST_LOG=_fast_log(), **pdl.launch_options(),
    )  # fmt: skip
    return best_value, best_index


def _pick_block(vocab_size: int) -> int:
    """``_pick_kernel``'s width: the most splits any batch size gives the vocabulary, so
    one kernel serves every batch (no compilation as the batch changes)."""
    return max(2, triton.next_power_of_2(triton.cdiv(vocab_size, BLOCK_V)))


def gumbel_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor | None,
    noise_scale: torch.Tensor | None,
    seed: torch.Tensor | None,
) -> torch.Tensor:
    """One token per row of ``logits`` ``[N, vocab]`` (any float dtype, last dim contiguous).

    ``temperature``: ``[N]`` float32 or None (all 1). ``noise_scale``: ``[N]`` float32 of 1
    (sample) and 0 (greedy: plain argmax) or None (all sample). ``seed``: int64 tensor of one
    element on the logits' device, or None: every row greedy (the plain argmax of each
    row, first index among ties, as ``torch.argmax``). Returns ``[N]`` int64 token ids.
    """
    best_value, best_index = gumbel_partials(logits, temperature, noise_scale, seed)
    num_rows, num_splits = best_value.shape
    tokens = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows:
        _pick_kernel[(num_rows,)](
            best_value, best_index, tokens, num_splits,
            BLOCK_S=_pick_block(logits.shape[1]), **pdl.launch_options(),
        )  # fmt: skip
    return tokens
