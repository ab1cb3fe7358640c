"""Routing a checkpoint's quantized blocks into the model's linear layers, for kernels that
compute on them (GGUF files: ``gguf_quantized``; GPTQ and AWQ checkpoints: ``quantization.
int_checkpoint``).

A block source gives each quantized checkpoint tensor as ``AffineBlocks`` (codes, and a
scale and a minimum per 32 or 16 columns) under its HF name and in HF row order. No model
knowledge is repeated here: the blocks go through the model's own ``load_weights`` and
weight loaders, once per part (codes, then scales, then minimums), with every 2-D parameter
temporarily replaced by a stand-in of the shape that part has (codes: the weight's shape;
scales and minimums: one column per group). Every step on the way copies whole rows or
group-aligned column slices, so each stand-in ends up holding its layer's blocks: q/k/v
stacked into ``qkv_proj``, gate/up into ``gate_up_proj``, this rank's tensor-parallel
shard, a tied LM head sharing the embedding's. Scales go at the finest group any tensor
has (a coarser tensor's repeated), and a layer whose scales come in equal pairs is handed
over at 32 columns again. Layers where routing does not give a layer its blocks are left
out, never approximated: a layer fed by a tensor without blocks (its scales keep the NaN
they start with), or whose blocks do not dequantize to exactly the float weight it was
loaded with (a ``load_weights`` that does more than copy), or whose input width is not a
multiple of 32.

Two ways in. ``linear_blocks_from`` routes blocks into a model loaded the ordinary way
(float weights dequantized) and checks each layer against its weight. ``load_keeping_blocks``
loads a model whose platform will put every such layer on its blocks: the blocks are
routed first, the float weights of the layers that get them are never computed (they are
what the kernels replace), and ``take_kept_blocks`` then hands those blocks over. Those
layers are checked by the parity tests rather than at start-up, since there is no float
weight to compare with.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Literal

import torch
from torch import nn

from pagedlm.model_executor.layers.linear_base import LinearBase
from pagedlm.model_executor.loader.gguf_blocks import GROUP_SIZE, AffineBlocks
from pagedlm.model_executor.loader.weight_utils import get_weight_loader, set_weight_loader

logger = logging.getLogger(__name__)

Part = Literal["codes", "scales", "mins", "sources"]
_PARTS: tuple[Part, ...] = ("codes", "scales", "mins")
_KEPT: weakref.WeakKeyDictionary[nn.Module, dict[str, AffineBlocks]] = weakref.WeakKeyDictionary()
"""Blocks ``load_keeping_blocks`` routed, until ``take_kept_blocks`` takes them."""


def _stand_in(weight: torch.Tensor, part: Part, group: int) -> torch.Tensor | None:
    rows, cols = _full_shape(weight)
    if part == "codes":
        # Uninitialized: codes are used only where the scales show every row was filled.
        return torch.empty(rows, cols, dtype=torch.uint8)
    if cols % GROUP_SIZE:
        return None
    return torch.full((rows, cols // group), float("nan"), dtype=torch.float32)


@contextmanager
def _stand_ins(
    model: nn.Module, part: Part, group: int = GROUP_SIZE
) -> Iterator[dict[int, torch.Tensor]]:
    """Every 2-D parameter replaced (in every module holding it) by a stand-in for ``part``
    (scales and minimums: one column per ``group``); yields ``{id(original parameter):
    stand-in data}`` and puts the originals back."""
    holders: list[tuple[nn.Module, str, nn.Parameter]] = []
    replacements: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for attr, param in list(module.named_parameters(recurse=False)):
            if len(_full_shape(param)) != 2:
                continue
            if id(param) not in replacements:
                data = _stand_in(param, part, group)
                if data is None:
                    continue
                replacement = nn.Parameter(data, requires_grad=False)
                set_weight_loader(replacement, get_weight_loader(param))
                replacements[id(param)] = replacement
            holders.append((module, attr, param))
            setattr(module, attr, replacements[id(param)])
    try:
        yield {key: value.data for key, value in replacements.items()}
    finally:
        for module, attr, param in holders:
            setattr(module, attr, param)


def unroutable_tensors(model: nn.Module, shapes: dict[str, tuple[int, ...]]) -> set[str]:
    """The names among ``shapes`` (HF name -> full shape) that ``load_weights`` feeds into a
    parameter that is not 2-D (mixture-of-experts weights stacked [experts, out, in]):
    their blocks cannot be routed, so those tensors are loaded dequantized. Found by one
    pass of shape-only tensors over parameters whose loaders only record what they get."""
    feeds: dict[str, set[int]] = {}
    current = [""]
    holders: list[tuple[nn.Module, str, nn.Parameter]] = []
    probes: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for attr, param in list(module.named_parameters(recurse=False)):
            if id(param) not in probes:
                ndim = len(_full_shape(param))
                probe = nn.Parameter(torch.empty(_full_shape(param), device="meta"), False)
                set_weight_loader(
                    probe, lambda *_args, ndim=ndim: feeds.setdefault(current[0], set()).add(ndim)
                )
                probes[id(param)] = probe
            holders.append((module, attr, param))
            setattr(module, attr, probes[id(param)])

    def shape_only() -> Iterator[tuple[str, torch.Tensor]]:
        for name, shape in shapes.items():
            current[0] = name
            yield name, torch.empty(shape, device="meta")

    try:
        with torch.no_grad():
            model.load_weights(shape_only())
    finally:
        for module, attr, param in holders:
            setattr(module, attr, param)
    return {name for name, ndims in feeds.items() if ndims != {2}}


def route_blocks(
    model: nn.Module, parts: Iterable[tuple[str, AffineBlocks]]
) -> tuple[dict[Part, dict[int, torch.Tensor]], set[str]]:
    """Each part of ``parts``' blocks through ``load_weights`` into stand-ins: {part:
    {id(parameter): its stand-in}}, and the names of the parameters that were fed. Scales
    go at the finest group any of the blocks has."""
    decoded = list(parts)
    group = min((blocks.group_size for _, blocks in decoded), default=GROUP_SIZE)
    if group < GROUP_SIZE:
        decoded = [(name, _regrouped(blocks, group)) for name, blocks in decoded]
    routed: dict[Part, dict[int, torch.Tensor]] = {}
    loaded: set[str] = set()
    with torch.no_grad():
        for part in _PARTS:
            with _stand_ins(model, part, group) as filled:
                loaded |= model.load_weights((name, getattr(b, part)) for name, b in decoded)
            routed[part] = filled
    return routed, loaded


def complete_layers(
    model: nn.Module, routed: dict[Part, dict[int, torch.Tensor]]
) -> dict[str, AffineBlocks]:
    """Module name -> blocks, for every ``LinearBase`` whose every row came from blocks."""
    found: dict[str, AffineBlocks] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase) or module.weight.dim() != 2:
            continue
        key = id(module.weight)
        if any(key not in routed[part] for part in _PARTS):
            continue
        blocks = AffineBlocks(*(routed[part][key] for part in _PARTS))
        if not torch.isnan(blocks.scales).any():  # NaN: rows from a tensor without blocks
            found[name] = _coarsest(blocks)
    return found


def _regrouped(blocks: AffineBlocks, group: int) -> AffineBlocks:
    """The same values with a scale and a minimum per ``group`` columns (each repeated)."""
    repeat = blocks.group_size // group
    if repeat == 1:
        return blocks
    return AffineBlocks(
        blocks.codes,
        blocks.scales.repeat_interleave(repeat, dim=1),
        blocks.mins.repeat_interleave(repeat, dim=1),
    )


def _coarsest(blocks: AffineBlocks) -> AffineBlocks:
    """Groups of 16 whose scales and minimums come in equal pairs, as groups of 32."""
    scales, mins = blocks.scales, blocks.mins
    if blocks.group_size != GROUP_SIZE // 2 or scales.shape[1] % 2:
        return blocks
    if torch.equal(scales[:, 0::2], scales[:, 1::2]) and torch.equal(mins[:, 0::2], mins[:, 1::2]):
        return AffineBlocks(blocks.codes, scales[:, 0::2].contiguous(), mins[:, 0::2].contiguous())
    return blocks


def _full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """A parameter's shape, or for a kept layer's emptied weight the shape it stands for."""
    return getattr(param, "full_shape", tuple(param.shape))


def _reproduces_weight(name: str, blocks: AffineBlocks, weight: torch.Tensor) -> bool:
    if weight.numel() == 0:  # a kept layer's weight: nothing to compare (blocks in a kernel)
        return False
    # Checked where the weight lives (the GPU dequantizes an 8B model in moments).
    on_device = AffineBlocks(*(getattr(blocks, p).to(weight.device) for p in _PARTS))
    if torch.equal(on_device.dequantize().to(weight.dtype), weight):
        return True
    logger.warning(
        "%s: the quantized blocks do not reproduce the loaded weight; it stays dense.", name
    )
    return False


def linear_blocks_from(
    model: nn.Module, blocks_by_tensor: Iterable[tuple[str, AffineBlocks]]
) -> dict[str, AffineBlocks]:
    """Module name -> its weight's blocks, for every ``LinearBase`` of ``model`` (loaded the
    ordinary way) whose whole weight came from ``blocks_by_tensor`` (HF name, blocks)."""
    blocks = list(blocks_by_tensor)
    skipped = unroutable_tensors(model, {name: tuple(b.codes.shape) for name, b in blocks})
    routed, _ = route_blocks(model, ((n, b) for n, b in blocks if n not in skipped))
    return {
        name: blocks
        for name, blocks in complete_layers(model, routed).items()
        if _reproduces_weight(name, blocks, model.get_submodule(name).weight)
    }


def take_kept_blocks(model: nn.Module) -> dict[str, AffineBlocks] | None:
    """The blocks ``load_keeping_blocks`` kept for ``model`` (once), or None."""
    return _KEPT.pop(model, None)


def load_keeping_blocks(
    model: nn.Module,
    blocks_by_tensor: dict[str, AffineBlocks],
    other_weights: Callable[[], Iterable[tuple[str, torch.Tensor]]],
    device: torch.device | None = None,
) -> set[str]:
    """Fill ``model`` from ``blocks_by_tensor`` (HF name -> blocks) and ``other_weights``
    (the checkpoint's float tensors, called once after the blocks are routed), keeping the
    blocks of every linear layer whose whole weight has them for ``take_kept_blocks``;
    returns the names of the parameters filled (for ``check_all_loaded``). Blocks that feed
    no 2-D parameter (``unroutable_tensors``) are taken out of ``blocks_by_tensor`` and
    loaded dequantized.

    The float weight of a kept layer that no other module shares is never made: it becomes
    an empty tensor (on ``device``; a linear weight built under ``linear_base.
    deferred_weights`` sits on the meta device until then, and other such weights get
    their memory here, then their values). The caller must give every kept layer a kernel
    on its blocks before the model runs. A shared one (an LM head tied to the embedding)
    is filled and checked against its blocks as in ``linear_blocks_from``.
    """
    shapes = {name: tuple(blocks.codes.shape) for name, blocks in blocks_by_tensor.items()}
    dense = {name: blocks_by_tensor.pop(name) for name in unroutable_tensors(model, shapes)}
    routed, loaded = route_blocks(model, blocks_by_tensor.items())
    found = complete_layers(model, routed)
    shared = {id(p) for p, n in _parameter_uses(model).items() if n > 1}
    unfilled = {
        id(model.get_submodule(name).weight)
        for name in found
        if id(model.get_submodule(name).weight) not in shared
    }
    needed = _tensors_feeding(model, blocks_by_tensor, skip=unfilled)
    kept_names = {name for name in found if id(model.get_submodule(name).weight) in unfilled}
    _allocate_weights(model, unfilled, device)

    def float_weights() -> Iterator[tuple[str, torch.Tensor]]:
        for name, blocks in blocks_by_tensor.items():
            if name in needed:
                yield name, blocks.dequantize()
        for name, blocks in dense.items():
            yield name, blocks.dequantize()
        yield from other_weights()

    with torch.no_grad():
        loaded |= model.load_weights(float_weights())
    if any(param.is_meta for param in model.parameters()):
        raise RuntimeError("load_keeping_blocks left a parameter without memory.")
    _KEPT[model] = {
        name: blocks
        for name, blocks in found.items()
        if name in kept_names or _reproduces_weight(name, blocks, model.get_submodule(name).weight)
    }
    return loaded


def _allocate_weights(model: nn.Module, kept: set[int], device: torch.device | None) -> None:
    """Give every parameter on the meta device (a linear weight built under
    ``deferred_weights``) memory on ``device``, uninitialized for the loader to fill, and
    every one in ``kept`` (ids) an empty tensor instead (a kernel over its blocks will
    compute the layer); in every module holding it."""
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for attr, param in list(module.named_parameters(recurse=False)):
            if id(param) not in replaced and (param.is_meta or id(param) in kept):
                at = device if param.is_meta else param.device
                shape = (0,) if id(param) in kept else param.shape
                new = nn.Parameter(torch.empty(shape, dtype=param.dtype, device=at), False)
                set_weight_loader(new, get_weight_loader(param))
                if id(param) in kept:  # so that a later routing still knows the layer's shape
                    new.full_shape = tuple(param.shape)  # type: ignore[attr-defined]
                replaced[id(param)] = new
            if id(param) in replaced:
                setattr(module, attr, replaced[id(param)])


def _parameter_uses(model: nn.Module) -> dict[nn.Parameter, int]:
    uses: dict[nn.Parameter, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[param] = uses.get(param, 0) + 1
    return uses


def _tensors_feeding(
    model: nn.Module, blocks_by_tensor: dict[str, AffineBlocks], skip: set[int]
) -> set[str]:
    """The checkpoint tensors of ``blocks_by_tensor`` that feed some parameter whose id is
    not in ``skip``: found by routing each tensor's index (one value per block) into
    stand-ins, the way the blocks went."""
    names = list(blocks_by_tensor)
    group = min((b.group_size for b in blocks_by_tensor.values()), default=GROUP_SIZE)
    with torch.no_grad(), _stand_ins(model, "sources", group) as filled:
        model.load_weights(
            (name, torch.full((b.codes.shape[0], b.codes.shape[1] // group), float(index)))
            for index, (name, b) in enumerate(blocks_by_tensor.items())
        )
    needed: set[str] = set()
    for key, sources in filled.items():
        if key not in skip:
            indices = sources[~torch.isnan(sources)].unique().tolist()
            needed.update(names[int(index)] for index in indices)
    return needed


__all__ = [
    "linear_blocks_from",
    "load_keeping_blocks",
    "route_blocks",
    "take_kept_blocks",
    "unroutable_tensors",
]
