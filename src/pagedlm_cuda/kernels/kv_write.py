"""Writing a step's new keys and values into the paged cache, by slot mapping.

The Triton backend's cache layout is ``[num_blocks, num_kv_heads, block_size, head_dim]``:
one kv head's keys of one block are a contiguous ``block_size * head_dim`` run, so the
attention kernels read each (block, head) as one piece instead of ``block_size`` rows
strided by ``num_kv_heads * head_dim``. An FP8 cache stores ``saturate(k / k_scale)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlm.kv_cache.fp8 import is_fp8
from pagedlm_cuda.kernels import pdl
from pagedlm_cuda.kernels.kv_tile import fp8_scales, fp8_store_value


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    k_scale_ptr, v_scale_ptr, key_stride_token, key_stride_head, value_stride_token, value_stride_head,
    cache_stride_block, cache_stride_head, cache_stride_slot,
    num_kv_heads, head_dim, block_size,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.start(USE_PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        # Padding rows of a CUDA-graph batch have no slot: they must not touch the cache.
        return
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    block = slot // block_size
    offset = slot % block_size
    dst = block * cache_stride_block + heads * cache_stride_head + offset * cache_stride_slot + dims
    k = tl.load(key_ptr + token * key_stride_token + heads * key_stride_head + dims, mask=mask)
    v = tl.load(
        value_ptr + token * value_stride_token + heads * value_stride_head + dims, mask=mask
    )
    k_scale, v_scale = fp8_scales(k_scale_ptr, v_scale_ptr, FP8)
    cache_dtype = key_cache_ptr.dtype.element_ty
    tl.store(key_cache_ptr + dst, fp8_store_value(k, k_scale, cache_dtype, FP8), mask=mask)
    tl.store(value_cache_ptr + dst, fp8_store_value(v, v_scale, cache_dtype, FP8), mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store ``key[t]``/``value[t]`` at slot ``slot_mapping[t]`` of the caches, in place.

    key, value: [num_tokens, num_kv_heads, head_dim] (last dim contiguous);
    key_cache, value_cache: [num_blocks, num_kv_heads, block_size, head_dim] (contiguous);
    slot_mapping: [num_tokens] int, ``block_id * block_size + offset``; a negative slot
    skips its token (padding). A float8 cache needs ``k_scale``/``v_scale`` (float32 [1]).
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1 or value.stride(-1) != 1 or not key_cache.is_contiguous():
        raise ValueError("write_kv_cache needs unit-stride head dims and contiguous caches.")
    if key_cache.shape[1] != num_kv_heads or key_cache.shape[3] != head_dim:
        raise ValueError(
            f"cache shape {tuple(key_cache.shape)} is not [num_blocks, {num_kv_heads}, "
            f"block_size, {head_dim}]; allocate it with TritonAttentionBackend.kv_cache_shape."
        )
    fp8 = is_fp8(key_cache.dtype)
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError("an FP8 KV cache needs k_scale and v_scale.")
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        k_scale if fp8 else slot_mapping, v_scale if fp8 else slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        num_kv_heads, head_dim, key_cache.shape[2],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        FP8=fp8, **pdl.launch_options(),
    )  # fmt: skip
