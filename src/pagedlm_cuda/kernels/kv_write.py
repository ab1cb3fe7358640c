"""Writing a step's new keys and values into the paged cache, by slot mapping.

The Triton backend's cache layout is ``[num_blocks, num_kv_heads, block_size, head_dim]``:
one kv head's keys of one block are a contiguous ``block_size * head_dim`` run, so the
attention kernels read each (block, head) as one piece instead of ``block_size`` rows
strided by ``num_kv_heads * head_dim``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlm_cuda.kernels import pdl


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    key_stride_token, key_stride_head, value_stride_token, value_stride_head,
    cache_stride_block, cache_stride_head, cache_stride_slot,
    num_kv_heads, head_dim, block_size,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
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
    tl.store(key_cache_ptr + dst, k, mask=mask)
    tl.store(value_cache_ptr + dst, v, mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key[t]``/``value[t]`` at slot ``slot_mapping[t]`` of the caches, in place.

    key, value: [num_tokens, num_kv_heads, head_dim] (last dim contiguous);
    key_cache, value_cache: [num_blocks, num_kv_heads, block_size, head_dim] (contiguous);
    slot_mapping: [num_tokens] int, ``block_id * block_size + offset``; a negative slot
    skips its token (padding).
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
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        num_kv_heads, head_dim, key_cache.shape[2],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        **pdl.launch_options(),
    )  # fmt: skip
