"""LayerNorm over each attention head of q or k (StableLM, Phi, Cohere's q/k norms)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.model_executor.loader.weight_utils import copy_checked, set_weight_loader, shard_of


class HeadLayerNorm(nn.Module):
    """Each head's features ``[head_dim]`` mean-subtracted and scaled to unit variance, in
    float32, then times its weight (plus its bias), cast back.

    The weight is shared by every head (``per_head=False``: Phi's one ``nn.LayerNorm``) or
    each head has its own (StableLM, Cohere), in which case this rank holds the rows of its
    heads ``first_head ..`` (``num_heads`` of them) and loads them from a full
    ``[total_heads, head_dim]`` tensor or, with ``shard_id`` = a head index, from one head's
    ``[head_dim]`` tensor (StableLM stores one per head; other ranks' heads are skipped).

    forward: x [num_tokens, num_heads * head_dim] -> same shape.
    """

    def __init__(
        self,
        head_dim: int,
        eps: float,
        *,
        num_heads: int = 1,
        first_head: int = 0,
        per_head: bool = True,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.eps = eps
        self.first_head = first_head
        shape = (num_heads, head_dim) if per_head else (head_dim,)
        self.weight = nn.Parameter(torch.ones(shape), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(shape), requires_grad=False)
            set_weight_loader(self.bias, self.weight_loader)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None
    ) -> None:
        if param.dim() == 1:  # shared by all heads
            copy_checked(param.data, loaded, "head norm")
            return
        num_heads = param.shape[0]
        if shard_id is None:
            rows = shard_of(loaded, 0, self.first_head // num_heads, num_heads)
            copy_checked(param.data, rows, "per-head norm")
        elif self.first_head <= shard_id < self.first_head + num_heads:
            copy_checked(param.data[shard_id - self.first_head], loaded, f"head {shard_id} norm")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = x.reshape(x.shape[0], -1, self.head_dim).float()
        out = F.layer_norm(heads, (self.head_dim,), eps=self.eps) * self.weight.float()
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype).view(x.shape[0], -1)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, first_head={self.first_head}"
