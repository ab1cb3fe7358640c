"""Triton kernels of the CUDA (and ROCm) backend.

Each module holds one kernel family and a thin Python wrapper that checks shapes and
launches it. Every wrapper works on any device Triton can target, and on CPU tensors under
``TRITON_INTERPRET=1`` (how the tests run them without a GPU).
"""

from pagedlm_cuda.kernels.activation import silu_and_mul
from pagedlm_cuda.kernels.decode_attention import paged_decode_attention
from pagedlm_cuda.kernels.kv_write import write_kv_cache
from pagedlm_cuda.kernels.prefill_attention import paged_prefill_attention
from pagedlm_cuda.kernels.rmsnorm import fused_add_rms_norm, rms_norm
from pagedlm_cuda.kernels.rotary import rotary_embedding
from pagedlm_cuda.kernels.verify_attention import paged_verify_attention

__all__ = [
    "fused_add_rms_norm",
    "paged_decode_attention",
    "paged_prefill_attention",
    "paged_verify_attention",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "write_kv_cache",
]
