"""CPU versions of the model's RMSNorm and rotary layers that make fewer torch calls.

On CPU a decode step of a small model is dominated, after its GEMMs, by the fixed cost of
each torch call (a few microseconds for an op on a 576-wide row, whatever it computes), so
these kernels compute the same values with fewer calls. They are handed to the layers
through ``set_kernel`` (``install_fused_kernels``, from ``CpuPlatform.prepare_model``),
as the CUDA platform hands its Triton kernels: the layers and models do not change.

- RMSNorm: the input converted to float32 once, its sum of squares in one call
  (``vector_norm``), the scale in two more on a ``[rows, 1]`` tensor, then ``x * scale``
  in place, rounded to the activation dtype and multiplied by the weight: what the torch
  code computes, in 6 calls instead of 9 (and no conversion hidden inside another op).
- Rotary (neox style): ``x * [cos, cos] + roll(x, d/2) * [-sin, sin]`` over q and k at
  once when k's columns follow q's in one buffer (the fused qkv projection's output).
  Both tables are gathered by one ``index_select`` per step, not per layer: the model's
  layers share one rotary module and pass it the step's one positions tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedlm.model_executor.layers.layernorm import RMSNorm
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``RMSNorm``'s kernel contract: (x, residual | None, weight, eps) -> the normalized
    ``x`` (after ``x + residual``, which is returned too as the next residual)."""
    if residual is not None:
        x = torch.add(x, residual)  # in the activation dtype, as the torch code sums it
        residual = x
    # One float32 copy up front: the norm and the product then convert nothing themselves.
    x32 = x if x.dtype == torch.float32 else x.float()
    squares = torch.linalg.vector_norm(x32, dim=-1, keepdim=True)
    # rsqrt(sum(x^2) / hidden + eps) with sum(x^2) = norm^2.
    scale = torch.addcmul(_eps(eps, squares), squares, squares, value=1.0 / x.shape[-1])
    scale = scale.rsqrt_()
    # A float32 input is the caller's tensor: multiplied into a new one, not in place.
    out = torch.mul(x, scale) if x32 is x else x32.mul_(scale).to(x.dtype)
    out = out.mul_(weight)
    return out if residual is None else (out, residual)


_EPS: dict[tuple[float, torch.device], torch.Tensor] = {}


def _eps(eps: float, like: torch.Tensor) -> torch.Tensor:
    """A float32 0-d tensor holding ``eps`` (cached: creating it is a call of its own)."""
    key = (eps, like.device)
    tensor = _EPS.get(key)
    if tensor is None:
        tensor = _EPS[key] = torch.tensor(eps, dtype=torch.float32, device=like.device)
    return tensor


class NeoxRotary:
    """``RotaryEmbedding``'s kernel contract for one neox-style layer: (positions [T],
    query [T, heads * d], key [T, kv_heads * d], cos_sin_cache, head_dim, is_neox_style,
    qk_norm=None) -> rotated (query, key), new tensors.

    Holds, per activation dtype, the table ``[max_position, 2, 1, head_dim]`` of ``[cos, cos]``
    and ``[-sin, sin]`` rounded to that dtype, as the torch code rounds cos and sin."""

    def __init__(self) -> None:
        self._tables: dict[torch.dtype, torch.Tensor] = {}
        # A copy of the last call's positions, the table and dtype, and their (cos, sin)
        # rows: a step's layers all pass the same positions, so the gather runs once per
        # step instead of once per layer. Reused only for equal positions: a persistent
        # positions buffer is rewritten in place between steps, sometimes where torch's
        # version counter cannot see it (through a numpy view of it; a graph replayed
        # over the same buffer), so neither its identity nor its version says it is
        # unchanged.
        self._last: tuple | None = None

    def rows(
        self, positions: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """([T, 1, head_dim] cos, sin) of ``positions``, reused while the positions, the
        table and the dtype are those of the last call."""
        last = self._last
        if (
            last is not None
            and last[1] is cos_sin_cache
            and last[2] == dtype
            and last[0].shape == positions.shape
            and torch.equal(last[0], positions)
        ):
            return last[3], last[4]
        cos, sin = self._table(cos_sin_cache, dtype).index_select(0, positions).unbind(1)
        self._last = (positions.clone(), cos_sin_cache, dtype, cos, sin)
        return cos, sin

    def _table(self, cos_sin_cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        table = self._tables.get(dtype)
        if table is None:
            cos, sin = cos_sin_cache.to(dtype).chunk(2, dim=-1)
            pairs = [torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)]
            table = torch.stack(pairs, 1)[:, :, None]  # [max_position, 2, 1, head_dim]
            self._tables[dtype] = table
        return table

    def __call__(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        head_dim: int,
        is_neox_style: bool,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not is_neox_style:
            raise ValueError("NeoxRotary rotates neox-style pairs only (the head's halves)")
        num_tokens = query.shape[0]
        if qk_norm is not None:
            q_weight, k_weight, eps = qk_norm
            query = rms_norm(query.view(num_tokens, -1, head_dim), None, q_weight, eps)
            key = rms_norm(key.view(num_tokens, -1, head_dim), None, k_weight, eps)
            query, key = query.view(num_tokens, -1), key.view(num_tokens, -1)
        cos, sin = self.rows(positions, cos_sin_cache, query.dtype)
        num_q = query.shape[1] // head_dim
        both = _adjacent_heads(query, key, head_dim)
        if both is None:
            return _rotate(query, cos, sin, head_dim), _rotate(key, cos, sin, head_dim)
        rotated = _rotate(both, cos, sin, head_dim).view(num_tokens, -1, head_dim)
        return (
            rotated[:, :num_q].reshape(num_tokens, -1),
            rotated[:, num_q:].reshape(num_tokens, -1),
        )


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """x [T, n * head_dim] (or [T, n, head_dim]) -> rotated [T, n * head_dim], new."""
    heads = x.view(x.shape[0], -1, head_dim) if x.dim() == 2 else x
    return rotate_heads(heads, cos, sin).view(x.shape[0], -1)


def rotate_heads(heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """heads [T, n, head_dim] -> ``heads * [cos, cos] + roll(heads, d/2) * [-sin, sin]``
    [T, n, head_dim], new (cos, sin: the [T, 1, head_dim] rows of ``NeoxRotary.rows``)."""
    out = torch.mul(heads, cos)
    out.addcmul_(torch.roll(heads, heads.shape[-1] // 2, dims=-1), sin)
    return out


def _adjacent_heads(query: torch.Tensor, key: torch.Tensor, head_dim: int) -> torch.Tensor | None:
    """[T, q_heads + kv_heads, head_dim]: one view over q's and k's heads where both are
    views of one buffer (the qkv projection's output) and k's columns directly follow q's
    in its rows; None otherwise. One storage is checked by its address, not by ``_base``:
    views made under ``torch.inference_mode`` (the engine's forward) have no ``_base``."""
    if (
        query.dim() != 2
        or query.stride() != key.stride()
        or query.stride(1) != 1
        or key.data_ptr() != query.data_ptr() + query.shape[1] * query.element_size()
        or key.untyped_storage().data_ptr() != query.untyped_storage().data_ptr()
    ):
        return None
    num_heads = (query.shape[1] + key.shape[1]) // head_dim
    return query.as_strided((query.shape[0], num_heads, head_dim), (query.stride(0), head_dim, 1))


def install_fused_kernels(model: nn.Module) -> int:
    """Hand every plain ``RMSNorm`` and neox-style ``RotaryEmbedding`` of ``model`` its CPU
    kernel; returns how many layers were switched. Subclasses (Gemma's norm, scaled or
    multimodal rotary variants) keep their own code; so do layers with a kernel already."""
    switched = 0
    for module in model.modules():
        if RMSNorm.takes_kernel(module) and module.kernel is None:
            module.set_kernel(rms_norm)
        elif (
            type(module) is RotaryEmbedding
            and module.kernel is None
            and module.is_neox_style
            and module.head_dim % 2 == 0
        ):
            module.set_kernel(NeoxRotary())
        else:
            continue
        switched += 1
    return switched
