"""A Llama-family decoder layer's pure-decode step in one function, for the CPU platform.

At batch 1 on CPU a decode step of a small model is mostly fixed costs: through the
modules, SmolLM2-135M's 30 layers take 14.5 ms per step (bf16, one Zen 4 core), of which
6.4 ms are int4 GEMMs and ~1.2 ms SDPA; the rest is module calls, the attention layer's
checks, splits and views, the backend's dispatch, a few microseconds each.
``DecodeLayerKernel`` is ``LlamaDecoderLayer``'s kernel (``set_kernel``): for a step whose
rows are all decodes it computes the block with the same torch ops in the same order on the
same tensors as the modules, so the results are bitwise the modules' own, with far fewer
Python calls: q/k/v and the gate/up halves are ``as_strided`` views instead of splits,
int4 layers call torch's kernel directly, the rotation's cos/sin rows and the attention's
key views are worked out once per step (``DecodeOnlyStep``) instead of once per layer.
The 30 layers then take 11.8 ms.

It declines (returns None, and the modules run) for every other step, chunks of prompts
included, and for anything it does not reproduce: a layer whose kernels are not the
platform's own (LoRA adapters, batch-invariant tiles), FP8 caches or caches of another
dtype, scales being measured. Layers it could never compute (sliding windows, soft caps,
non-causal attention, attention sinks, tensor parallelism, other norms, rotations or MLPs)
get no kernel.
``PAGEDLM_CPU_FAST_DECODE=0`` installs none.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.model_executor.forward_context import ForwardContext
from pagedlm.model_executor.layers.activation import SiluAndMul
from pagedlm.model_executor.layers.attention import Attention
from pagedlm.model_executor.layers.layernorm import RMSNorm
from pagedlm.model_executor.layers.linear_base import LinearBase
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagedlm.model_executor.loader.gguf_blocks import GROUP_SIZE
from pagedlm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
from pagedlm_cpu.attention import CpuSdpaBackend, DecodeOnlyStep
from pagedlm_cpu.fused_layers import NeoxRotary, rms_norm, rotate_heads
from pagedlm_cpu.linear import OneDnnLinear
from pagedlm_cpu.quantized_linear import INT4_MM, Int4Linear
from pagedlm_cpu.row_split_linear import RowSplitLinear

FAST_DECODE_ENV = "PAGEDLM_CPU_FAST_DECODE"
"""Set to 0 to run every decode step through the modules (no ``DecodeLayerKernel``)."""

_LINEAR_KERNELS = (Int4Linear, RowSplitLinear, OneDnnLinear)
"""Linear kernels a layer may have for ``DecodeLayerKernel`` to compute it (or none)."""


class StepState:
    """What every layer of one decode step shares, made by its first layer: the step's
    attention (``DecodeOnlyStep``) and the rotation's cos/sin rows per rotary kernel."""

    def __init__(self, metadata: object, positions: torch.Tensor, attention: DecodeOnlyStep):
        # Held, not only compared by id: while held, no other step's metadata can take its
        # address. The positions too: a step's forward passes the same tensor to every layer.
        self.metadata = metadata
        self.positions = positions
        self.attention = attention
        self.rotations: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def rotation(
        self, rotary: RotaryEmbedding, kernel: NeoxRotary, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """([T, 1, head_dim] cos, sin) of the step's positions, as ``kernel`` gathers them."""
        rows = self.rotations.get(id(kernel))
        if rows is None or rows[0].dtype != dtype:
            rows = kernel.rows(self.positions, rotary.cos_sin_cache, dtype)
            self.rotations[id(kernel)] = rows
        return rows


class StepStates:
    """The current step's ``StepState``, shared by the kernels of one model's layers."""

    def __init__(self) -> None:
        self.current: StepState | None = None

    def get(
        self, positions: torch.Tensor, num_tokens: int, ctx: ForwardContext
    ) -> StepState | None:
        """This step's state, or None where its attention is not decodes only."""
        state = self.current
        if (
            state is not None
            and state.metadata is ctx.attn_metadata
            and state.positions is positions
        ):
            return state
        self.current = None
        backend = ctx.attn_backend
        if type(backend) is not CpuSdpaBackend or positions.dim() != 1:
            return None
        attention = backend.decode_only_step(ctx.attn_metadata, num_tokens)
        if attention is None:
            return None
        self.current = StepState(ctx.attn_metadata, positions, attention)
        return self.current


LinearFn = Callable[[torch.Tensor], torch.Tensor]


def _module_linear(layer: LinearBase) -> LinearFn | None:
    """What ``layer.apply_linear`` calls: its kernel, or ``F.linear`` on its weight; None
    for a kernel this module does not know (LoRA adapters, batch-invariant tiles)."""
    kernel = layer.kernel
    if kernel is None:
        return functools.partial(F.linear, weight=layer.weight, bias=layer.linear_bias)
    return kernel if type(kernel) in _LINEAR_KERNELS else None


def _int4_linear(kernel: object, contiguous: bool) -> tuple[LinearFn, int] | None:
    """(x -> torch's int4 op on x, the most rows it serves) where ``kernel`` computes bf16
    rows up to that many as that one op (one plane, no padding, no bias), which
    ``Int4Linear`` calls with ``x.contiguous()``; None where it does not."""
    if isinstance(kernel, RowSplitLinear):
        most_rows = kernel.dense_from_rows - 1
        kernel = kernel.quantized
    elif isinstance(kernel, Int4Linear):
        most_rows = kernel.max_rows
    else:
        return None
    assert isinstance(kernel, Int4Linear)
    packed, scale_zeros = kernel.packed, kernel.scale_zeros
    # scale_zeros [groups, padded rows, 2]: padded rows would need the output cut.
    if (
        kernel.num_planes != 1
        or kernel.bias is not None
        or scale_zeros.shape[1] != kernel.out_features
    ):
        return None
    most_rows = min(most_rows, kernel.max_rows)
    if contiguous:
        return lambda x: INT4_MM(x.contiguous(), packed, GROUP_SIZE, scale_zeros), most_rows
    return lambda x: INT4_MM(x, packed, GROUP_SIZE, scale_zeros), most_rows


class DecodeLayerKernel:
    """``LlamaDecoderLayer``'s kernel: (positions, x, residual | None, ctx) -> (x,
    residual) for a step of decodes only, None for other steps (see the module's doc)."""

    def __init__(self, layer: LlamaDecoderLayer, states: StepStates) -> None:
        attn: LlamaAttention = layer.self_attn  # type: ignore[assignment]
        mlp: LlamaMLP = layer.mlp  # type: ignore[assignment]
        self.states = states
        self.input_norm = layer.input_layernorm
        self.post_norm = layer.post_attention_layernorm
        self.attention = attn.attn
        self.rotary = attn.rotary_emb
        self.act_fn = mlp.act_fn
        self.linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        qkv = attn.qkv_proj
        self.layer_idx = attn.attn.layer_idx
        self.scale = attn.attn.scale
        self.num_heads, self.num_kv_heads = qkv.num_heads, qkv.num_kv_heads
        self.head_dim = qkv.head_dim
        self.q_size, self.kv_size = qkv.q_size, qkv.kv_size
        self.intermediate = mlp.gate_up_proj.output_sizes[0]
        self.qk_norm = (
            None if attn.q_norm is None or attn.k_norm is None else (attn.q_norm, attn.k_norm)
        )
        self._kernels: tuple[object, ...] = ()
        self._module_fns: tuple[LinearFn, ...] | None = None
        self._int4_fns: tuple[LinearFn, ...] | None = None
        self._int4_rows = 0

    def _current_kernels(self) -> tuple[object, ...]:
        return (
            self.input_norm.kernel,
            self.post_norm.kernel,
            self.rotary.kernel,
            self.act_fn.kernel,
            *(linear.kernel for linear in self.linears),
        )

    def _linear_fns(self, num_tokens: int, dtype: torch.dtype) -> tuple[LinearFn, ...] | None:
        """The four linear layers' functions for a step of ``num_tokens`` rows of ``dtype``
        (None: a kernel this module does not reproduce). Planned from the layers' kernels
        and checked against them by identity on every call: LoRA and batch-invariant mode
        replace kernels after the platform installed this one."""
        known = self._kernels
        qkv, o_proj, gate_up, down = self.linears
        if not (
            known
            and qkv.kernel is known[4]
            and o_proj.kernel is known[5]
            and gate_up.kernel is known[6]
            and down.kernel is known[7]
            and self.input_norm.kernel is known[0]
            and self.post_norm.kernel is known[1]
            and self.rotary.kernel is known[2]
            and self.act_fn.kernel is known[3]
        ):
            self._plan()
        if num_tokens <= self._int4_rows and dtype == torch.bfloat16:
            return self._int4_fns
        return self._module_fns

    def _plan(self) -> None:
        kernels = self._kernels = self._current_kernels()
        self._module_fns = self._int4_fns = None
        self._int4_rows = 0
        if not (
            kernels[0] is rms_norm
            and kernels[1] is rms_norm
            and isinstance(kernels[2], NeoxRotary)
            and kernels[3] is None
        ):
            return
        module_fns = tuple(_module_linear(linear) for linear in self.linears)
        if any(fn is None for fn in module_fns):
            return
        self._module_fns = module_fns  # type: ignore[assignment]
        int4 = [
            _int4_linear(linear.kernel, contiguous=linear is self.linears[1])
            for linear in self.linears
        ]
        if all(pair is not None for pair in int4):
            self._int4_fns = tuple(fn for fn, _ in int4)  # type: ignore[misc]
            self._int4_rows = min(rows for _, rows in int4)  # type: ignore[misc]

    def __call__(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        num_tokens = x.shape[0]
        state = self.states.get(positions, num_tokens, ctx)
        if state is None or self.attention.calculate_kv_scales:
            return None
        linears = self._linear_fns(num_tokens, x.dtype)
        if linears is None:
            return None
        key_cache, value_cache = ctx.kv_cache.layer(self.layer_idx)
        if key_cache.dtype != x.dtype:
            return None  # FP8 (or another dtype's) cache: the backend converts
        qkv_proj, o_proj, gate_up_proj, down_proj = linears
        norm = self.input_norm
        if residual is None:
            residual = x
            x = rms_norm(x, None, norm.weight, norm.eps)
        else:
            x, residual = rms_norm(x, residual, norm.weight, norm.eps)
        x = o_proj(self._attend(state, qkv_proj(x), key_cache, value_cache))
        norm = self.post_norm
        x, residual = rms_norm(x, residual, norm.weight, norm.eps)
        gate_up = gate_up_proj(x)
        size, row = self.intermediate, gate_up.stride(0)
        gate = gate_up.as_strided((num_tokens, size), (row, 1))
        up = gate_up.as_strided((num_tokens, size), (row, 1), gate_up.storage_offset() + size)
        return down_proj(F.silu(gate) * up), residual

    def _attend(
        self,
        state: StepState,
        qkv: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> torch.Tensor:
        """qkv [T, q_size + 2 * kv_size] -> attention's output [T, heads * head_dim]: the
        rotation ``NeoxRotary`` applies, then ``DecodeOnlyStep``."""
        num_tokens, row, start = qkv.shape[0], qkv.stride(0), qkv.storage_offset()
        head_dim, num_heads, num_kv_heads = self.head_dim, self.num_heads, self.num_kv_heads
        rotary, kernel = self.rotary, self.rotary.kernel
        value = qkv.as_strided(
            (num_tokens, num_kv_heads, head_dim), (row, head_dim, 1),
            start + self.q_size + self.kv_size,
        )  # fmt: skip
        cos, sin = state.rotation(rotary, kernel, qkv.dtype)
        if self.qk_norm is None:
            # q's and k's heads side by side, rotated in one pass (NeoxRotary's own path).
            both = qkv.as_strided(
                (num_tokens, num_heads + num_kv_heads, head_dim), (row, head_dim, 1)
            )
            rotated = rotate_heads(both, cos, sin)
            stride = rotated.stride()
            key = rotated.as_strided(
                (num_tokens, num_kv_heads, head_dim), stride, num_heads * head_dim
            )
        else:
            q_norm, k_norm = self.qk_norm
            query, key = kernel(
                state.positions,
                qkv.as_strided((num_tokens, self.q_size), (row, 1), start),
                qkv.as_strided((num_tokens, self.kv_size), (row, 1), start + self.q_size),
                rotary.cos_sin_cache,
                head_dim,
                rotary.is_neox_style,
                qk_norm=(q_norm.weight, k_norm.weight, q_norm.eps),
            )
            rotated = query.view(num_tokens, num_heads, head_dim)
            key = key.view(num_tokens, num_kv_heads, head_dim)
        group = num_heads // num_kv_heads
        query = rotated.as_strided(
            (num_tokens, num_kv_heads, group, head_dim),
            (rotated.stride(0), group * head_dim, head_dim, 1),
        )
        out = state.attention(query, key, value, key_cache, value_cache, self.scale)
        return out.reshape(num_tokens, num_heads * head_dim)


def _decodable(layer: nn.Module) -> bool:
    """Whether ``layer`` is a Llama-family block ``DecodeLayerKernel`` can compute at all."""
    if type(layer) is not LlamaDecoderLayer:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) is not LlamaAttention or type(mlp) is not LlamaMLP:
        return False
    attention, rotary = attn.attn, attn.rotary_emb
    qkv = attn.qkv_proj
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    qk_norms = (attn.q_norm, attn.k_norm)
    return (
        all(type(norm) is RMSNorm for norm in norms)
        and (qk_norms == (None, None) or all(type(norm) is RMSNorm for norm in qk_norms))
        and (attn.q_norm is None or attn.q_norm.eps == attn.k_norm.eps)
        and type(attention) is Attention
        and not attention._extra_kwargs  # sliding window, soft cap, non-causal
        and attention.sinks is None
        and attention.head_dim == qkv.head_dim
        and attention.num_heads == qkv.num_heads
        and attention.num_kv_heads == qkv.num_kv_heads
        and type(rotary) is RotaryEmbedding
        and rotary.is_neox_style
        and rotary.head_dim == qkv.head_dim
        and type(mlp.act_fn) is SiluAndMul
        and all(
            isinstance(linear, LinearBase) and getattr(linear, "tp_size", 1) == 1
            for linear in (qkv, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        )
        and len(set(mlp.gate_up_proj.output_sizes)) == 1
    )


def install_decode_kernels(model: nn.Module) -> int:
    """Hand every Llama-family decoder layer of ``model`` that ``DecodeLayerKernel`` can
    compute its kernel (the layers share one ``StepStates``); returns how many."""
    states = StepStates()
    count = 0
    for module in model.modules():
        if isinstance(module, LlamaDecoderLayer) and module.kernel is None and _decodable(module):
            module.set_kernel(DecodeLayerKernel(module, states))
            count += 1
    return count
