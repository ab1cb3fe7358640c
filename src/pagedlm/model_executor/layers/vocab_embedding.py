"""Token embedding and LM head, split across ranks by vocabulary rows.

Each rank holds rows ``rank * rows_per_rank ..`` of the ``[vocab_size, hidden]`` table,
``rows_per_rank = ceil(vocab_size / tp)``; the last rank's rows past ``vocab_size`` are
zero padding, and the LM head drops their logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from pagedlm.model_executor.layers.linear_base import LinearBase, linear_weight
from pagedlm.model_executor.loader.weight_utils import copy_checked, set_weight_loader


class VocabParallelEmbedding(nn.Module):
    """forward: input_ids [num_tokens] -> [num_tokens, embedding_dim]."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.rows_per_rank = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)
        self.weight = self._new_weight(self.rows_per_rank, embedding_dim)
        set_weight_loader(self.weight, self.weight_loader)

    @staticmethod
    def _new_weight(rows: int, cols: int) -> nn.Parameter:
        return nn.Parameter(torch.empty(rows, cols), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if loaded_weight.shape[0] != self.num_embeddings:
            raise ValueError(
                f"checkpoint vocabulary has {loaded_weight.shape[0]} rows but config.json "
                f"says vocab_size={self.num_embeddings}; the checkpoint does not match its config."
            )
        num_rows = self.vocab_end - self.vocab_start
        copy_checked(param.data[:num_rows], loaded_weight[self.vocab_start : self.vocab_end])
        param.data[num_rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        # Ids of other ranks look up row 0 and are zeroed; the all-reduce fills them in.
        is_local = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(is_local, input_ids - self.vocab_start, 0)
        embeddings = F.embedding(local_ids, self.weight) * is_local.unsqueeze(-1)
        return tensor_model_parallel_all_reduce(embeddings)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp_size={self.tp_size}"


class ParallelLMHead(VocabParallelEmbedding, LinearBase):
    """forward: hidden_states [N, hidden] -> logits [N, vocab_size] in the weights' dtype
    (the sampler computes in float32 where it needs to; a float32 copy of a batch's logits
    would cost a full extra pass over them every step).

    For tied embeddings, call ``tie_to(embedding)``: both then share one parameter.
    ``bias`` (Phi): a bias per vocabulary row, split across ranks as the rows are.
    """

    _new_weight = staticmethod(linear_weight)  # a linear weight: deferred like the others

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.rows_per_rank), requires_grad=False)
            set_weight_loader(self.bias, self.weight_loader)  # the weight's rows, padded alike

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.apply_linear(hidden_states)
        if self.tp_size > 1:
            logits = tensor_model_parallel_all_gather(logits)[:, : self.num_embeddings]
        return logits
