"""Rotary position embedding applied in place to q and k, neox or gptj pairing.

neox: pair ``i`` is (x[i], x[i + rot/2]) — the head's two halves (HF Llama layout).
gptj: pair ``i`` is (x[2i], x[2i + 1]) — interleaved.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlm.attention.backend import FusedRotary
from pagedlm_cuda.kernels import pdl


@triton.jit
def _rotate_heads(
    x_ptr, stride_token, stride_head, token, num_heads, cos, sin, norm_weight_ptr, eps,
    IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    heads = tl.arange(0, BLOCK_H)[:, None]
    pairs = tl.arange(0, HALF)[None, :]
    mask = heads < num_heads
    base = x_ptr + token * stride_token + heads * stride_head
    if IS_NEOX:
        first_offsets = pairs
        second_offsets = HALF + pairs
    else:
        first_offsets = 2 * pairs
        second_offsets = 2 * pairs + 1
    first = tl.load(base + first_offsets, mask=mask, other=0.0)
    second = tl.load(base + second_offsets, mask=mask, other=0.0)
    f32 = first.to(tl.float32)
    s32 = second.to(tl.float32)
    if NORM:
        # RMSNorm over each head (Qwen3's q/k norms), rounded exactly as the unfused
        # norm kernel rounds its output before the rotary kernel would read it.
        sum_sq = tl.sum(f32 * f32, axis=1) + tl.sum(s32 * s32, axis=1)
        rstd = tl.rsqrt(sum_sq / (2 * HALF) + eps)[:, None]
        w_first = tl.load(norm_weight_ptr + first_offsets).to(tl.float32)
        w_second = tl.load(norm_weight_ptr + second_offsets).to(tl.float32)
        f32 = ((f32 * rstd).to(first.dtype).to(tl.float32) * w_first).to(first.dtype)
        s32 = ((s32 * rstd).to(first.dtype).to(tl.float32) * w_second).to(first.dtype)
        f32 = f32.to(tl.float32)
        s32 = s32.to(tl.float32)
    tl.store(base + first_offsets, (f32 * cos - s32 * sin).to(first.dtype), mask=mask)
    tl.store(base + second_offsets, (s32 * cos + f32 * sin).to(first.dtype), mask=mask)


def fused_rotary_args(
    rotary: FusedRotary | None, head_dim: int, has_new_kv: bool, unused: torch.Tensor
) -> tuple[tuple, dict]:
    """An attention kernel's rotary arguments: (positions, cos_sin, q_norm, k_norm
    pointers; cos_sin stride, norm eps) and the constexprs ``ROTARY``, ``IS_NEOX``,
    ``QK_NORM``; ``unused`` stands in for the pointers without ``rotary``. A fused
    rotation needs the step's new keys (it rotates them before storing them) and a
    power-of-two head_dim of at least 16 (one tile holds both halves of a head)."""
    if rotary is None:
        flags = dict(ROTARY=False, IS_NEOX=True, QK_NORM=False)
        return (unused, unused, unused, unused, 1, 0.0), flags
    if not has_new_kv or head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(
            "a fused rotary needs new_kv (the keys it rotates) and a power-of-two head_dim "
            f">= 16; got head_dim={head_dim}, new_kv={'set' if has_new_kv else None}."
        )
    q_norm, k_norm, eps = rotary.qk_norm or (unused, unused, 0.0)
    cos_sin = rotary.cos_sin_cache
    flags = dict(ROTARY=True, IS_NEOX=rotary.is_neox_style, QK_NORM=rotary.qk_norm is not None)
    return (rotary.positions, cos_sin, q_norm, k_norm, cos_sin.stride(0), eps), flags


@triton.jit
def fused_angles(
    cos_sin_ptr, positions, cos_sin_stride, dims, HALF: tl.constexpr, IS_NEOX: tl.constexpr
):  # fmt: skip
    """For attention kernels that rotate what they load (``FusedRotary``): each dim's
    pair partner ([D]) and, at ``positions`` (int64, any shape ``S``), the cos and the
    signed sin of its pair's angle ([*S, D], float32; the sine negated where the dim is
    its pair's first, so ``x * cos + partner * signed_sin`` is the rotation)."""
    if IS_NEOX:  # pairs (i, i + HALF)
        partner = dims ^ HALF
        pair = dims % HALF
        first = dims < HALF
    else:  # pairs (2i, 2i + 1)
        partner = dims ^ 1
        pair = dims // 2
        first = dims % 2 == 0
    rows = cos_sin_ptr + tl.expand_dims(positions * cos_sin_stride, -1)
    cos = tl.load(rows + pair).to(tl.float32)
    sin = tl.load(rows + HALF + pair).to(tl.float32)
    return partner, cos, tl.where(first, -sin, sin)


@triton.jit
def rotate_loaded(
    x, rows, mask, partner, cos, signed_sin, norm_ptr, norm_eps, dims, head_dim,
    QK_NORM: tl.constexpr,
):  # fmt: skip
    """``x`` ([R, D], loaded at ``rows + dims``, ``rows`` [R, 1] or a scalar) rotated:
    its partners are loaded at ``rows + partner``; ``cos`` and ``signed_sin`` broadcast
    to [R, D] (``fused_angles``). Under ``QK_NORM`` each row is first RMS-normalized with
    ``norm_ptr``'s weights. Rounded to ``x``'s dtype where ``_rotate_heads`` rounds, so
    the result is the separate kernel's up to the order of the norm's sum and to which
    products the compiler fuses into multiply-adds (exactly equal under the interpreter)."""
    other = tl.load(rows + partner[None, :], mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    other32 = other.to(tl.float32)
    if QK_NORM:
        rstd = tl.rsqrt(tl.sum(x32 * x32, axis=1) / head_dim + norm_eps)[:, None]
        weight = tl.load(norm_ptr + dims).to(tl.float32)[None, :]
        other_weight = tl.load(norm_ptr + partner).to(tl.float32)[None, :]
        x32 = ((x32 * rstd).to(x.dtype).to(tl.float32) * weight).to(x.dtype).to(tl.float32)
        other32 = (other32 * rstd).to(x.dtype).to(tl.float32) * other_weight
        other32 = other32.to(x.dtype).to(tl.float32)
    return (x32 * cos + other32 * signed_sin).to(x.dtype)


@triton.jit
def rotate_at(
    x, rows, mask, positions, cos_sin_ptr, cos_sin_stride, norm_ptr, norm_eps, dims,
    head_dim, IS_NEOX: tl.constexpr, QK_NORM: tl.constexpr,
):  # fmt: skip
    """``rotate_loaded`` of ``x`` [R, D] at per-row ``positions`` [R] (int64), for kernels
    whose rows sit at different positions; the angles are read here (``fused_angles``)."""
    partner, cos, signed_sin = fused_angles(
        cos_sin_ptr, positions, cos_sin_stride, dims, x.shape[1] // 2, IS_NEOX
    )  # fmt: skip
    return rotate_loaded(
        x, rows, mask, partner, cos, signed_sin, norm_ptr, norm_eps, dims, head_dim, QK_NORM
    )  # fmt: skip


@triton.jit
def _rotary_kernel(
    positions_ptr, query_ptr, key_ptr, cos_sin_ptr, q_norm_ptr, k_norm_ptr,
    q_stride_token, q_stride_head, k_stride_token, k_stride_head, cos_sin_stride,
    num_heads, num_kv_heads, eps,
    IS_NEOX: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, HALF: tl.constexpr,
    NORM: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.allow_next(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    # Positions come from a host copy and the table never changes: both are read before
    # waiting for the kernel that produced q and k.
    pos = tl.load(positions_ptr + token).to(tl.int64)
    pairs = tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_sin_ptr + pos * cos_sin_stride + pairs).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * cos_sin_stride + HALF + pairs).to(tl.float32)
    pdl.wait_for_previous(USE_PDL)
    _rotate_heads(query_ptr, q_stride_token, q_stride_head, token, num_heads, cos, sin,
                  q_norm_ptr, eps, IS_NEOX, BLOCK_HQ, HALF, NORM)  # fmt: skip
    _rotate_heads(key_ptr, k_stride_token, k_stride_head, token, num_kv_heads, cos, sin,
                  k_norm_ptr, eps, IS_NEOX, BLOCK_HK, HALF, NORM)  # fmt: skip


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
    is_neox_style: bool = True,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k in place by their tokens' positions and return them.

    ``qk_norm`` = (q_weight [head_dim], k_weight [head_dim], eps): first RMS-normalize each
    head of q and k with those weights (Qwen3), in the same pass.

    positions: [T] int; query: [T, num_heads * head_dim]; key: [T, num_kv_heads * head_dim]
    (each may be a strided view, e.g. a slice of the fused qkv output, but rows must have a
    unit-stride last dim); cos_sin_cache: [max_position, head_dim] float32, the cos of each
    pair's angle followed by its sin. head_dim must be a power of two.
    """
    num_tokens = query.shape[0]
    if num_tokens == 0:
        return query, key
    if head_dim & (head_dim - 1):
        raise ValueError(f"rotary_embedding needs a power-of-two head_dim, got {head_dim}.")
    if query.stride(-1) != 1 or key.stride(-1) != 1:
        raise ValueError("rotary_embedding needs query and key rows with a unit-stride last dim.")
    num_heads = query.shape[1] // head_dim
    num_kv_heads = key.shape[1] // head_dim
    q_weight, k_weight, eps = (
        qk_norm if qk_norm is not None else (cos_sin_cache, cos_sin_cache, 0.0)
    )
    _rotary_kernel[(num_tokens,)](
        positions,
        query,
        key,
        cos_sin_cache,
        q_weight,
        k_weight,
        query.stride(0),
        head_dim,
        key.stride(0),
        head_dim,
        cos_sin_cache.stride(0),
        num_heads,
        num_kv_heads,
        eps,
        IS_NEOX=is_neox_style,
        BLOCK_HQ=triton.next_power_of_2(num_heads),
        BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        HALF=head_dim // 2,
        NORM=qk_norm is not None,
        **pdl.launch_options(),
    )
    return query, key
