"""``quantization="bitsandbytes"``: linear layers quantized at load, computed by bitsandbytes.

After the checkpoint is loaded, every ``LinearBase`` layer except the LM head (whose error
would land directly on the logits, and which may share its table with the embedding) is
quantized one layer at a time; its float weight is dropped right away and replaced by the
packed parameter, so the model shrinks as it goes. The layer then computes through a
bitsandbytes kernel (``LinearBase.set_kernel``); the packed weight's integer dtype keeps
platform prepacking (e.g. oneDNN, float weights only) from touching it.

- ``nf4`` / ``fp4``: 4-bit codes in blocks of 64 weights, one absmax scale per block
  (0.5 byte per weight plus 4 bytes per 64; ~0.56 byte/weight).
- ``int8``: LLM.int8 without outlier decomposition: per-output-row absmax scales for the
  weight, per-token scales for the activations, int32 accumulation (1 byte/weight).

bitsandbytes >= 0.45 runs these on CPU as well as CUDA; it is imported only here.

Pre-quantized HF checkpoints (``quantization_config.quant_method == "bitsandbytes"``) are
dequantized while streaming and quantized again after loading. That round trip is exact:
our q/k/v and gate/up merges stack whole rows, so every 64-weight block and its absmax are
the ones in the file, and each dequantized weight maps back to its original code.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedlm.model_executor.layers.linear_base import LinearBase
from pagedlm.model_executor.layers.vocab_embedding import ParallelLMHead

BNB_QUANT_TYPES = ("nf4", "fp4", "int8")
BLOCK_SIZE_4BIT = 64


def import_bitsandbytes() -> Any:
    """The bitsandbytes module, or an error that says how to install it."""
    try:
        import bitsandbytes
    except ImportError as error:
        raise ImportError(
            'quantization="bitsandbytes" needs the bitsandbytes package: '
            "pip install 'pagedlm[bnb]' (or pip install 'bitsandbytes>=0.45'); "
            f"importing it failed with: {error}"
        ) from error
    return bitsandbytes


class FourBitKernel:
    """``x W^T + b`` with W stored as 4-bit codes. x: [num_tokens, in] -> [num_tokens, out]."""

    def __init__(self, packed: torch.Tensor, quant_state: Any, bias: torch.Tensor | None) -> None:
        self.packed = packed
        self.quant_state = quant_state
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        bnb = import_bitsandbytes()
        return bnb.matmul_4bit(x, self.packed.t(), quant_state=self.quant_state, bias=self.bias)


class Int8Kernel:
    """``x W^T + b`` with W as int8 rows and float row scales (``weight_scales [out]``)."""

    def __init__(
        self, codes: torch.Tensor, weight_scales: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        self.codes = codes
        self.weight_scales = weight_scales.float()
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from bitsandbytes import functional

        # bitsandbytes' CUDA int8 ops take float16 only (as LLM.int8 always did).
        x_codes, x_scales, _ = functional.int8_vectorwise_quant(x.to(torch.float16))
        accumulated = functional.int8_linear_matmul(x_codes, self.codes)  # int32 [tokens, out]
        # Both operands were scaled to [-127, 127] by their absmax.
        scale = x_scales.float()[:, None] * (self.weight_scales[None, :] / (127.0 * 127.0))
        out = accumulated.float() * scale
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype)


def quantize_linear(module: LinearBase, quant_type: str) -> None:
    """Replace ``module.weight [out, in]`` by its packed form and install the matching kernel."""
    from bitsandbytes import functional

    weight = module.weight.data
    bias = module.linear_bias
    bias = None if bias is None else bias.detach()
    if quant_type == "int8":
        codes, scales, _ = functional.int8_vectorwise_quant(weight.to(torch.float16))
        packed, kernel = codes, Int8Kernel(codes, scales, bias)
    else:
        packed, state = functional.quantize_4bit(
            weight, blocksize=BLOCK_SIZE_4BIT, quant_type=quant_type
        )
        kernel, scales = FourBitKernel(packed, state, bias), state.absmax
    module.weight = nn.Parameter(packed, requires_grad=False)
    # A buffer, so the scales move with the module and count in its memory.
    module.register_buffer("weight_scales", scales, persistent=False)
    module.set_kernel(kernel)


def quantize_model(model: nn.Module, quant_type: str = "nf4") -> int:
    """Quantize every linear layer of ``model`` but the LM head and MoE routers
    (``LinearBase.quantized_at_load``); returns how many."""
    if quant_type not in BNB_QUANT_TYPES:
        raise ValueError(
            f"bnb_quant_type={quant_type!r} is not one of {', '.join(BNB_QUANT_TYPES)}."
        )
    import_bitsandbytes()
    count = 0
    with torch.no_grad():
        for module in model.modules():
            if (
                isinstance(module, LinearBase)
                and not isinstance(module, ParallelLMHead)
                and module.quantized_at_load
            ):
                quantize_linear(module, quant_type)
                count += 1
    return count


def bytes_of_parameters(model: nn.Module) -> int:
    """Bytes held by the model's parameters and buffers (each shared tensor counted once)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


# Tensors HF stores beside a 4-bit ``<layer>.weight`` (QuantState.as_dict(packed=True)).
_FOUR_BIT_PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
_FOUR_BIT_STATE = "quant_state.bitsandbytes__"


def checkpoint_quant_type(hf_config: dict[str, Any]) -> str | None:
    """ "nf4" / "fp4" / "int8" for a bitsandbytes-quantized HF checkpoint, else None."""
    quantization_config = hf_config.get("quantization_config") or {}
    if quantization_config.get("quant_method") != "bitsandbytes":
        return None
    if quantization_config.get("load_in_8bit"):
        return "int8"
    return quantization_config.get("bnb_4bit_quant_type", "fp4")  # transformers' default


def _owner(name: str, tensor: torch.Tensor) -> tuple[str, str] | None:
    """(the ``.weight`` a quantized tensor belongs to, its part) or None for a plain tensor."""
    if name.endswith(".weight") and tensor.dtype in (torch.uint8, torch.int8):
        return name, "data"
    if name.endswith(".SCB"):
        return name.removesuffix(".SCB") + ".weight", "SCB"
    stem, _, part = name.partition(".weight.")
    if part in _FOUR_BIT_PARTS or part.startswith(_FOUR_BIT_STATE):
        return stem + ".weight", part
    return None


def _dequantize_parts(name: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    from bitsandbytes import functional

    if "data" not in parts:
        raise ValueError(f"the bitsandbytes checkpoint has quantization state but no {name}.")
    if "SCB" in parts:  # 8-bit: int8 rows times their absmax / 127
        return parts["data"].float() * (parts["SCB"].float()[:, None] / 127.0)
    if not any(part.startswith(_FOUR_BIT_STATE) for part in parts):
        raise ValueError(
            f"{name} is stored as {parts['data'].dtype} without its bitsandbytes quantization "
            "state (absmax, quant_map, quant_state.*); the checkpoint is incomplete."
        )
    state = functional.QuantState.from_dict(
        {part: tensor for part, tensor in parts.items() if part != "data"}, torch.device("cpu")
    )
    return functional.dequantize_4bit(parts["data"], state).float()


def dequantize_checkpoint(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Float32 weights from a bitsandbytes HF checkpoint; other tensors pass through.

    A layer's packed weight and its state may sit anywhere in the stream (even in different
    shards), so quantized parts are gathered (at most the packed checkpoint's size, 1/8 to
    1/4 of the float weights) and dequantized one layer at a time at the end.
    """
    import_bitsandbytes()
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        owner = _owner(name, tensor)
        if owner is None:
            yield name, tensor
        else:
            pending.setdefault(owner[0], {})[owner[1]] = tensor
    for name in list(pending):
        yield name, _dequantize_parts(name, pending.pop(name))
