"""pagedlm's own layers in place of transformers' ``nn.Linear`` and ``nn.Embedding`` inside
the Transformers modeling backend, so that what acts on pagedlm's layers reaches a model
pagedlm does not implement: a platform's GEMV/GEMM kernels (``prepare_model``),
``quantization="fp8"`` and tensor parallelism.

How each linear layer is split across ranks is the model's own tensor-parallel plan,
``config.base_model_tp_plan`` (module-name patterns with ``*`` for a layer index, as
transformers' own tensor parallelism reads it):
- ``colwise``: output features split (``ColumnParallelLinear``), no communication;
- ``rowwise``: input features split, results all-reduced (``RowParallelLinear``);
- ``colwise_gather_output``: output features split, then gathered whole (a packed
  gate/up projection, whose halves a plain split would mix);
- ``rowwise_split_input``: the whole input arrives; each rank takes its slice of it, then
  the results are all-reduced;
- ``replicated_with_grad_allreduce`` and ``embedding_rowwise``: left whole on every rank.

Invariants:
- At one rank every layer computes exactly what ``nn.Linear`` / ``nn.Embedding`` did, on
  any leading shape (rows are flattened for pagedlm's kernels, which take 2-D inputs).
- Under tensor parallelism every attention module's query/key/value projections are
  ``colwise``, so each rank attends over its own ``1/tp`` of the heads (the KV cache is
  sized so); a plan that gathers them (Olmo2's whole-projection norms), leaves a linear
  layer of a decoder layer without a style, or uses another style is refused before
  any memory is allocated (``tensor_parallel_refusal``); so is a module with a parameter
  of more than two dimensions (MoE experts fused as [num_experts, ...]), whatever the plan.
- Only an exact ``nn.Linear`` or ``nn.Embedding`` is replaced; a subclass (a router whose
  forward returns a tuple, a scaled embedding) stays as transformers built it, replicated
  (a linear subclass refuses tensor parallelism).
- An RMSNorm module is replaced by pagedlm's ``RMSNorm`` (a platform's fused kernel) only
  where a probe shows the two give the same bits, in float32 and bfloat16, on random
  weights and inputs (``computes_like_rmsnorm``); any other norm (Gemma's ``1 + weight``,
  a LayerNorm) stays transformers'.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import torch
from torch import nn

from pagedlm.model_executor.layers.layernorm import RMSNorm
from pagedlm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedlm.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

COLWISE, ROWWISE = "colwise", "rowwise"
GATHERED, SPLIT_INPUT = "colwise_gather_output", "rowwise_split_input"
REPLICATED = frozenset({"replicated_with_grad_allreduce", "embedding_rowwise"})
LINEAR_STYLES = frozenset({COLWISE, ROWWISE, GATHERED, SPLIT_INPUT})


def _rows(forward: Any, x: torch.Tensor) -> torch.Tensor:
    """``forward`` over ``x`` [..., in] as [rows, in] -> [..., out]."""
    out = forward(x.reshape(-1, x.shape[-1]))
    return out.view(*x.shape[:-1], out.shape[-1])


class ColumnLinear(ColumnParallelLinear):
    """transformers' ``nn.Linear`` as a column-parallel layer (whole at one rank)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rows(super().forward, x)


class RowLinear(RowParallelLinear):
    """transformers' ``nn.Linear`` as a row-parallel layer; ``split_input``: it receives the
    whole input and takes this rank's slice of it first."""

    def __init__(self, *args: Any, split_input: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.split_input = split_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split_input and self.tp_size > 1:
            x = x.narrow(-1, self.tp_rank * self.in_per_rank, self.in_per_rank)
        return _rows(super().forward, x)


class Norm(RMSNorm):
    """transformers' RMSNorm over [..., hidden] as pagedlm's (kernels take 2-D inputs)."""

    same_math = True  # platforms' RMSNorm kernels serve it

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _rows(super().forward, x)


def computes_like_rmsnorm(module: nn.Module) -> float | None:
    """``module``'s epsilon when it is an RMSNorm computing exactly what ``RMSNorm`` does
    (probed on a float32 and a bfloat16 copy on the CPU); None otherwise."""
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not isinstance(eps, float):
        return None
    if not type(module).__name__.endswith("RMSNorm") or list(module.children()):
        return None
    with torch.device("cpu"):  # whatever device the model is being built on
        return eps if _probe(module, weight.shape[0], eps) else None


def _probe(module: nn.Module, size: int, eps: float) -> bool:
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        probe = copy.deepcopy(module).to_empty(device="cpu").to(dtype)
        ours = RMSNorm(size, eps).to(dtype)
        values = torch.rand(size, generator=generator) + 0.5
        x = torch.randn((3, size), generator=generator).to(dtype)
        with torch.no_grad():
            probe.weight.copy_(values)
            ours.weight.copy_(values)
            try:
                same = torch.equal(probe(x), ours(x))
            except Exception:  # another signature: not a plain norm
                return False
        if not same:
            return False
    return True


class Embedding(VocabParallelEmbedding):
    """transformers' input ``nn.Embedding``, split by vocabulary rows across ranks."""


def plan_styles(config: Any) -> list[tuple[re.Pattern[str], str]]:
    """``config.base_model_tp_plan`` as (pattern over module names, style) pairs."""
    plan = getattr(config, "base_model_tp_plan", None) or {}
    return [
        (re.compile(re.escape(key).replace(r"\*", r"\d+")), style) for key, style in plan.items()
    ]


def style_of(name: str, styles: list[tuple[re.Pattern[str], str]]) -> str | None:
    """The plan's style for the base model's module ``name`` (None: the plan is silent)."""
    return next((style for pattern, style in styles if pattern.fullmatch(name)), None)


def tensor_parallel_refusal(base_model: nn.Module, config: Any, tp_size: int) -> str | None:
    """Why ``base_model`` (built on the meta device) cannot be split over ``tp_size`` ranks
    by its plan; None when it can (always at one rank)."""
    if tp_size == 1:
        return None
    styles = plan_styles(config)
    if not styles:
        return "its config has no tensor-parallel plan (base_model_tp_plan)"
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % tp_size or kv_heads % tp_size:
        return (
            f"its {heads} attention heads and {kv_heads} key/value heads do not split "
            f"evenly over {tp_size} ranks"
        )
    for name, module in base_model.named_modules():
        fused = [n for n, p in module.named_parameters(recurse=False) if p.dim() > 2]
        if fused:  # whatever the plan says of them (5.25's Mixtral plan says nothing)
            return (
                f"its {type(module).__name__} keeps MoE experts fused in {name}.{fused[0]}, "
                "which pagedlm does not split across ranks"
            )
        style = style_of(name, styles)
        if style is not None and style not in LINEAR_STYLES | REPLICATED:
            return f"its plan splits {name} as {style!r}, which pagedlm does not implement"
        if isinstance(module, nn.Linear) and type(module) is not nn.Linear:
            return f"its linear layer {name} is a {type(module).__name__}, which pagedlm does not split"
        if isinstance(module, nn.Linear) and style not in LINEAR_STYLES:
            return f"its plan does not say how to split the linear layer {name}"
        if is_attention_module(module):
            projections = [
                style_of(f"{name}.{child}", styles)
                for child, sub in module.named_children()
                if isinstance(sub, nn.Linear)
            ]
            if COLWISE not in projections or GATHERED in projections:
                return (
                    f"its plan keeps every attention head of {name} on each rank "
                    "(the query/key/value projections are not split by head)"
                )
    return None


def is_attention_module(module: nn.Module) -> bool:
    """transformers' attention module of one decoder layer (it knows its ``layer_idx``)."""
    return type(module).__name__.endswith("Attention") and isinstance(
        getattr(module, "layer_idx", None), int
    )


def swap_layers(hf_model: nn.Module, config: Any) -> None:
    """Replace, in transformers' ``*ForCausalLM`` ``hf_model`` (built on the meta device,
    checked by ``tensor_parallel_refusal``), every linear layer of its base model, its
    RMSNorms that compute as pagedlm's, its input embedding (an exact ``nn.Embedding``)
    and its LM head by pagedlm's layers, allocated empty on the current device; a tied LM
    head stays tied."""
    base = hf_model.base_model
    styles = plan_styles(config)
    embedding = hf_model.get_input_embeddings()
    head = hf_model.get_output_embeddings()
    tied = head is not None and head.weight is embedding.weight
    norms: dict[tuple[type, Any], float | None] = {}  # probed once per class and epsilon
    for name, module in list(base.named_modules()):
        if type(module) is nn.Linear:  # a subclass (a router returning a tuple) stays
            _replace(base, name, _linear(module, style_of(name, styles)))
            continue
        key = (type(module), getattr(module, "variance_epsilon", getattr(module, "eps", None)))
        if key[0].__name__.endswith("RMSNorm"):
            if key not in norms:
                norms[key] = computes_like_rmsnorm(module)
            if norms[key] is not None:
                _replace(base, name, Norm(module.weight.shape[0], norms[key]))
    if type(embedding) is nn.Embedding:
        new_embedding = Embedding(embedding.num_embeddings, embedding.embedding_dim)
        hf_model.set_input_embeddings(new_embedding)
        embedding = new_embedding
    if isinstance(head, nn.Linear):
        lm_head = ParallelLMHead(head.out_features, head.in_features, bias=head.bias is not None)
        if tied:
            if not isinstance(embedding, VocabParallelEmbedding) and lm_head.tp_size > 1:
                raise ValueError(
                    f"{type(hf_model).__name__} ties its LM head to a "
                    f"{type(embedding).__name__}, which pagedlm does not split across "
                    "ranks; run it with tensor_parallel_size=1."
                )
            lm_head.tie_to(embedding)
        hf_model.set_output_embeddings(lm_head)


def _linear(module: nn.Linear, style: str | None) -> nn.Module:
    bias = module.bias is not None
    if style in (ROWWISE, SPLIT_INPUT):
        return RowLinear(
            module.in_features, module.out_features, bias=bias, split_input=style == SPLIT_INPUT
        )
    # Unsplit at one rank; column-split (gathered where the plan says) under parallelism.
    return ColumnLinear(
        module.in_features, module.out_features, bias=bias, gather_output=style == GATHERED
    )


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, new)
