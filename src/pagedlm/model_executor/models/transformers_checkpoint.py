"""Saved tensor names to transformers' parameters in the Transformers modeling backend, as
transformers' own loader maps them (``transformers.core_model_loading``): first its
``WeightRenaming`` transforms (GPT-NeoX's ``embed_out`` to ``lm_head``, Mixtral's
``block_sparse_moe`` to ``mlp``, ...), then at most one ``WeightConverter``, which makes one
parameter of several saved tensors (MoE experts saved one by one, ``mlp.experts.3.up_proj
.weight``, stacked and concatenated into the fused ``mlp.experts.gate_up_proj``
[num_experts, 2 * intermediate, hidden]).

``ExpertMerges`` holds a converter's saved tensors until every one its target is made of
has arrived, then merges them with a fresh copy of transformers' own converter, sources in
transformers' order, so the parameter holds what ``from_pretrained`` puts there.

Invariants:
- Only the sources of targets not complete yet are held; a completed target's are dropped
  once its parameter is filled.
- How many saved tensors a target is made of is what transformers saves it as
  (``revert_weight_conversion`` of the parameter's shape, on the meta device).
- A merged tensor fills a parameter only if its name and shape are the parameter's; a
  transformers whose converter API this module does not know refuses, naming the fix.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from torch import nn

UPGRADE = (
    "use a transformers 5 release whose core_model_loading has WeightConverter, "
    "dot_natural_key and revert_weight_conversion (5.17 and 5.25 do), or save the "
    "checkpoint with its experts fused (save_pretrained(..., save_original_format=False))"
)


def _transforms(model: nn.Module) -> list[Any]:
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping

        transforms = get_model_conversion_mapping(model)
    except (ImportError, TypeError, AttributeError):  # a transformers without them
        return []
    return [t for t in transforms if hasattr(t, "rename_source_key")]


def checkpoint_renames(model: nn.Module) -> list[Any]:
    """transformers' renames of saved tensor names to its modules' (``lm_head`` saved as
    GPT-NeoX's ``embed_out``, old LayerNorm ``gamma``/``beta``, ...): its
    ``WeightRenaming`` transforms for ``model``, in order."""
    return [t for t in _transforms(model) if type(t).__name__ == "WeightRenaming"]


def renamed(name: str, renames: list[Any]) -> str:
    """``name`` after each of ``checkpoint_renames``' transforms, in order."""
    for rename in renames:
        name = rename.rename_source_key(name)[0]
    return name


@dataclass(frozen=True)
class _ConverterApi:
    """What ``ExpertMerges`` uses of ``transformers.core_model_loading``."""

    natural_key: Callable[[str], Any]
    revert: Callable[[nn.Module, dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def _converter_api(saved_name: str) -> _ConverterApi:
    try:
        from transformers.core_model_loading import dot_natural_key, revert_weight_conversion
    except ImportError as error:
        raise ValueError(
            f"checkpoint tensor {saved_name!r} is one of those transformers merges into one "
            f"parameter when it loads, but transformers {transformers.__version__} does not "
            f"offer the functions the Transformers backend merges with ({error}); {UPGRADE}."
        ) from error
    return _ConverterApi(dot_natural_key, revert_weight_conversion)


@dataclass
class _Pending:
    """The saved tensors of one target parameter seen so far."""

    converter: Any
    expected: int
    sources: dict[str, tuple[str, Any]] = field(default_factory=dict)
    """saved name -> (the converter's source pattern it matched, tensor)."""


class ExpertMerges:
    """transformers' ``WeightConverter`` transforms of ``model`` (its ``*ForCausalLM``,
    parameters allocated): saved tensors in, merged parameters out once complete."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.converters = [t for t in _transforms(model) if hasattr(t, "operations")]
        self.params = dict(model.named_parameters())
        self.pending: dict[str, _Pending] = {}

    def target_of(self, name: str) -> tuple[str, Any, str] | None:
        """(parameter, converter, its source pattern) that the renamed saved tensor
        ``name`` is merged into; None when no converter makes a parameter of it."""
        for converter in self.converters:  # as transformers: the first that matches
            target, pattern = converter.rename_source_key(name)
            if pattern is not None:
                return (target, converter, pattern) if target in self.params else None
        return None

    def add(
        self, saved_name: str, merge: tuple[str, Any, str], tensor: Any
    ) -> dict[str, torch.Tensor]:
        """Hold ``tensor`` (saved as ``saved_name``) for its target ``merge`` (from
        ``target_of``); the target's merged parameters {name: tensor} once this was its last
        source, else {}."""
        target, converter, pattern = merge
        api = _converter_api(saved_name)
        pending = self.pending.get(target)
        if pending is None:
            pending = _Pending(converter, self._source_count(target, saved_name, api))
            self.pending[target] = pending
        pending.sources[saved_name] = (pattern, tensor)
        if len(pending.sources) < pending.expected:
            return {}
        del self.pending[target]
        return self._merge(target, pending, api)

    def finish(self) -> None:
        """Refuse a load that left a target's sources incomplete."""
        if not self.pending:
            return
        target, pending = next(iter(self.pending.items()))
        raise ValueError(
            f"the checkpoint has {len(pending.sources)} of the {pending.expected} tensors "
            f"transformers merges into {target} ({', '.join(sorted(pending.sources))}); "
            "it is incomplete or does not match its config.json."
        )

    def _source_count(self, target: str, saved_name: str, api: _ConverterApi) -> int:
        param = self.params[target]
        try:
            saved = api.revert(self.model, {target: torch.empty(param.shape, device="meta")})
        except Exception as error:  # an op without a reverse: no way to know its sources
            raise ValueError(
                f"checkpoint tensor {saved_name!r} is one of those transformers merges into "
                f"{target}, but transformers {transformers.__version__} cannot say which "
                f"saved tensors make it ({type(error).__name__}: {error}); {UPGRADE}."
            ) from error
        return len(saved)

    def _merge(self, target: str, pending: _Pending, api: _ConverterApi) -> dict[str, torch.Tensor]:
        dtype = self.params[target].dtype
        converter = copy.deepcopy(pending.converter)  # a fresh one per target, as transformers
        for saved_name in sorted(pending.sources, key=api.natural_key):
            pattern, tensor = pending.sources.pop(saved_name)
            converter.add_tensor(target, saved_name, pattern, _read(tensor).to(dtype))
        try:
            merged = converter.convert(target, model=self.model, config=self.model.config)
        except Exception as error:
            raise ValueError(
                f"transformers {transformers.__version__}'s {converter!r} failed to merge the "
                f"checkpoint's tensors into {target} ({type(error).__name__}: {error}); {UPGRADE}."
            ) from error
        out = {
            name: value[0] if isinstance(value, list) else value for name, value in merged.items()
        }
        for name, value in out.items():
            param = self.params.get(name)
            if param is None or not isinstance(value, torch.Tensor) or value.shape != param.shape:
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
                raise ValueError(
                    f"transformers {transformers.__version__} merged the checkpoint's tensors "
                    f"for {target} into {name!r} of shape {got}, which is not a parameter of "
                    f"that shape in the model; {UPGRADE}."
                )
        return out


def _read(tensor: Any) -> torch.Tensor:
    """A plain tensor of a checkpoint tensor that may not be read yet (``SafetensorsSlice``)."""
    return tensor if isinstance(tensor, torch.Tensor) else tensor.materialize()
