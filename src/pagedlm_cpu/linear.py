"""Linear layers through oneDNN with weights prepacked once at load.

oneDNN's blocked weight layout roughly halves the time of a decode-sized matmul compared
with the BLAS path behind ``F.linear`` (measured on AMD EPYC: 2.1x at 32 rows, 1.8x at 1
row, SmolLM2-135M shapes, fp32), and it runs bf16 natively on CPUs with AVX-512 BF16.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from pagedlm.model_executor.layers.linear_base import LinearBase

logger = logging.getLogger(__name__)

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
_BATCH_SIZE_HINT = 32
"""oneDNN picks its blocking for this many rows; measured fastest for 1..256 rows."""


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class OneDnnLinear:
    """``x W^T + b`` with ``W`` reordered into oneDNN's layout. x: [num_tokens, in]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_SIZE_HINT)
        self.bias = None if bias is None else bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def prepack_linears(model: nn.Module) -> int:
    """Give every packable linear layer of ``model`` a oneDNN kernel; returns how many.

    The plain weight of a layer is released once packed (the packed copy is the only one
    used from then on), unless another module shares it (a tied embedding).
    """
    if not onednn_available():
        logger.info("oneDNN is not available in this torch build; using F.linear.")
        return 0
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    count = 0
    for module in model.modules():
        if isinstance(module, LinearBase) and module.weight.dtype in _PACKABLE_DTYPES:
            module.set_kernel(OneDnnLinear(module.weight, module.linear_bias))
            if uses[id(module.weight)] == 1:
                module.weight.data = module.weight.data.new_empty(0)
            count += 1
    return count
