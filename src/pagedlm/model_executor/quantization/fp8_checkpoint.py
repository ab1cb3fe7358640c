"""Pre-quantized FP8 checkpoints: vLLM's ``fp8`` layout and ``compressed-tensors``.

Both store a quantized linear layer's weight as an ``F8_E4M3`` safetensors tensor
``<layer>.weight`` beside a float32 ``<layer>.weight_scale`` (one per tensor, or one per
output row), and with static activation scales an ``<layer>.input_scale``. Which layers
are quantized is read off the file itself (the dtypes in the safetensors headers), routed
through the model's own ``load_weights`` once over shape-only tensors (``_probe``), so no
model's name mapping (q/k/v into ``qkv_proj``, ...) is repeated here and ignore lists of
either layout need no parsing. Per-tensor scales are repeated over their tensor's rows
while streaming (a merged q/k/v layer then holds each projection's scale on its rows), so
every layer ends up with per-row scales.

E4M3 mixture-of-experts weights (per-tensor or per-row scales, one tensor per expert
projection) are dequantized while they stream and quantized again per row with the
model's other experts (``FusedMoE.quantize_fp8``; a per-row checkpoint's codes come back
exactly); their static input scales are dropped, as experts take 16-bit activations.

Refused with a message: block-wise or per-group weight scales, integer or non-8-bit
compressed-tensors schemes, E4M3 tensors feeding anything but a linear layer or an
expert (embeddings) or the LM head, experts stored stacked, and a layer fed by both E4M3
and float tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedlm.model_executor.layers.linear_base import LinearBase
from pagedlm.model_executor.layers.vocab_embedding import ParallelLMHead
from pagedlm.model_executor.quantization.fp8 import FP8_DTYPE, add_fp8_parameters

logger = logging.getLogger(__name__)

FP8_CHECKPOINT_METHODS = ("fp8", "compressed-tensors")
_SCALE_SUFFIXES = (".weight_scale", ".input_scale")
_DROPPED_SUFFIXES = (".k_scale", ".v_scale", ".q_scale", ".kv_scale", ".output_scale")
"""KV-cache and output scales some FP8 checkpoints carry; the weights do not use them."""


@dataclass(frozen=True)
class Fp8CheckpointScheme:
    method: str
    """ "fp8" (vLLM's layout) or "compressed-tensors"."""
    static_input_scales: bool
    """Activations use the checkpoint's per-tensor ``input_scale`` (else: per token)."""
    block_size: tuple[int, int] | None = None
    """``weight_block_size`` (Qwen3-FP8, DeepSeek-V3): a float32 ``weight_scale_inv`` per
    [rows, cols] block of each E4M3 weight. Such a checkpoint is dequantized while it
    streams (``dequantize_blocks``) and its layers quantized again per row, as
    ``quantization="fp8"`` quantizes a float model."""


def _unsupported(what: str) -> ValueError:
    return ValueError(
        f"This FP8 checkpoint uses {what}, which pagedlm does not read; it reads E4M3 weights "
        "with per-tensor or per-channel scales (vLLM 'fp8' or compressed-tensors "
        "'float-quantized'). Load the float checkpoint with quantization='fp8' instead."
    )


def _compressed_tensors_scheme(config: dict[str, Any]) -> bool:
    """Whether the activations have static scales; refuses what is not E4M3 per tensor/row."""
    if config.get("format") not in ("float-quantized", "naive-quantized"):
        raise _unsupported(f"compressed-tensors format {config.get('format')!r}")
    groups = config.get("config_groups") or {}
    if not groups:
        raise _unsupported("compressed-tensors without config_groups")
    static = set()
    for group in groups.values():
        weights = group.get("weights") or {}
        if (weights.get("type"), weights.get("num_bits")) != ("float", 8):
            raise _unsupported(f"{weights.get('num_bits')}-bit {weights.get('type')} weights")
        if weights.get("strategy") not in ("tensor", "channel"):
            raise _unsupported(f"{weights.get('strategy')!r} weight scales")
        if weights.get("symmetric") is False:
            raise _unsupported("asymmetric weights (zero points)")
        activations = group.get("input_activations")
        if activations is None:  # weight-only: activations are quantized per token here
            static.add(False)
            continue
        if (activations.get("type"), activations.get("num_bits")) != ("float", 8):
            raise _unsupported(f"{activations.get('num_bits')}-bit activations")
        static.add(not activations.get("dynamic", True))
    if len(static) > 1:
        raise _unsupported("static activation scales for some layers and dynamic for others")
    return static.pop()


def fp8_checkpoint_scheme(hf_config: dict[str, Any]) -> Fp8CheckpointScheme | None:
    """The FP8 scheme of a pre-quantized checkpoint's config.json, None for other ones."""
    config = hf_config.get("quantization_config") or {}
    method = config.get("quant_method")
    if method == "fp8":
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise _unsupported(f"activation_scheme {scheme!r}")
        block = config.get("weight_block_size")
        if block:
            if scheme != "dynamic" or len(block) != 2 or min(block) < 1:
                raise _unsupported(f"weight_block_size {block} with {scheme} activations")
            return Fp8CheckpointScheme(method, False, (int(block[0]), int(block[1])))
        return Fp8CheckpointScheme(method, static_input_scales=scheme == "static")
    if method == "compressed-tensors":
        return Fp8CheckpointScheme(method, static_input_scales=_compressed_tensors_scheme(config))
    if method == "modelopt":
        return _modelopt_scheme(config)
    return None


def _modelopt_scheme(config: dict[str, Any]) -> Fp8CheckpointScheme:
    """NVIDIA ModelOpt's "FP8" checkpoints store vLLM's ``fp8`` layout: per-tensor
    ``weight_scale`` and static ``input_scale``."""
    algorithm = config.get("quant_algo")
    if algorithm != "FP8":
        raise _unsupported(f"ModelOpt quant_algo {algorithm!r} (only 'FP8' is read)")
    return Fp8CheckpointScheme("fp8", static_input_scales=True)


def _meta_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


@contextmanager
def _probe(
    model: nn.Module, names: dict[int, set[str]] | None = None
) -> Iterator[dict[int, set[torch.dtype]]]:
    """Every parameter replaced by one whose loader records the dtypes it is given and copies
    nothing; yields ``{id(original parameter): dtypes}`` and puts the originals back. With
    ``names``, also the checkpoint names of the tensors each parameter was given, where the
    model hands its loader the tensor it read (``_named_meta_tensor``'s tag)."""
    seen: dict[int, set[torch.dtype]] = {}
    holders: list[tuple[nn.Module, str, nn.Parameter]] = []
    probes: dict[int, nn.Parameter] = {}

    def record(key: int, loaded: torch.Tensor) -> None:
        seen.setdefault(key, set()).add(loaded.dtype)
        name = getattr(loaded, "checkpoint_name", None)
        if names is not None and name is not None:
            names.setdefault(key, set()).add(name)

    for module in model.modules():
        for attr, param in list(module.named_parameters(recurse=False)):
            if id(param) not in probes:
                key = id(param)
                probe = nn.Parameter(_meta_tensor(param.shape, param.dtype), requires_grad=False)
                probe.weight_loader = lambda _p, loaded, *_s, key=key: record(key, loaded)
                probes[key] = probe
            holders.append((module, attr, param))
            setattr(module, attr, probes[id(param)])
    try:
        yield seen
    finally:
        for module, attr, param in holders:
            setattr(module, attr, param)


def _named_meta_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    tensor = _meta_tensor(shape, dtype)
    tensor.checkpoint_name = name  # type: ignore[attr-defined]
    return tensor


def _fp8_layers(
    model: nn.Module, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
) -> tuple[list[LinearBase], set[str]]:
    """The linear layers every weight tensor of which is E4M3 in the checkpoint, and the
    checkpoint names of the E4M3 tensors that fill ``FusedMoE`` experts."""
    from pagedlm.model_executor.layers.moe import FusedMoE

    weights = [(n, s) for n, s in shapes.items() if not n.endswith(_SCALE_SUFFIXES)]
    weights = [(n, s) for n, s in weights if not n.endswith(_DROPPED_SUFFIXES)]
    names: dict[int, set[str]] = {}
    with _probe(model, names) as seen:
        model.load_weights((name, _named_meta_tensor(name, *spec)) for name, spec in weights)
    experts = {
        id(param)
        for module in model.modules()
        if isinstance(module, FusedMoE)
        for param in (module.w13, module.w2)
    }
    expert_names = {
        name
        for key in experts
        if FP8_DTYPE in seen.get(key, set())
        for name in names.get(key, set())
        if shapes[name][1] == FP8_DTYPE
    }
    for key in experts:
        if FP8_DTYPE in seen.get(key, set()):
            given = {n for n in names.get(key, set()) if shapes[n][1] == FP8_DTYPE}
            if not given:  # the model split the tensor before its loader saw it
                raise _unsupported("E4M3 experts stored stacked")
            seen[key].discard(FP8_DTYPE)
    owners = {id(p): (name, p) for name, p in model.named_parameters(remove_duplicate=False)}
    layers = []
    for name, module in model.named_modules():
        dtypes = seen.get(id(getattr(module, "weight", None)), set())
        is_linear = isinstance(module, LinearBase) and not isinstance(module, ParallelLMHead)
        if FP8_DTYPE not in dtypes:
            continue
        if not is_linear or dtypes != {FP8_DTYPE}:
            what = "a mix of E4M3 and float tensors" if is_linear else "E4M3 tensors"
            raise _unsupported(f"{what} for {name or 'the model'} ({type(module).__name__})")
        layers.append(module)
    linear_weights = {id(m.weight) for m in layers}
    for key, dtypes in seen.items():
        if FP8_DTYPE in dtypes and key not in linear_weights:
            raise _unsupported(f"E4M3 tensors for {owners[key][0]}, which is no linear layer")
    return layers, expert_names


_DROP = "drop"


def _join_codes_and_scales(
    weights: Iterable[tuple[str, torch.Tensor]],
    part_of: Callable[[str, torch.Tensor], tuple[str, str] | str | None],
    join: Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream with each layer's E4M3 codes and their float32 scale (``part_of`` names
    them ``(layer, "codes" | "scale")``, in either order) yielded once both have come, as
    ``<layer>.weight`` = ``join(layer, codes, scale)``; tensors ``part_of`` gives None pass
    through, those it gives ``_DROP`` are left out. A layer missing one part fails."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        part = part_of(name, tensor)
        if part is None:
            yield name, tensor
            continue
        if part == _DROP:
            continue
        layer, kind = part
        parts = pending.setdefault(layer, {})
        parts[kind] = tensor
        if len(parts) == 2:
            del pending[layer]
            yield f"{layer}.weight", join(layer, parts["codes"], parts["scale"].float())
    if pending:
        layer, parts = next(iter(pending.items()))
        raise ValueError(
            f"the FP8 checkpoint has {layer}'s {next(iter(parts))} but not its "
            f"{'scale' if 'codes' in parts else 'E4M3 weight'}; it is incomplete."
        )


def _dequantize_experts(
    weights: Iterable[tuple[str, torch.Tensor]], expert_names: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream with each E4M3 expert weight in ``expert_names`` and its ``weight_scale``
    (per tensor or per row) joined into the float32 weight, and the experts' input scales
    dropped (experts take 16-bit activations); ``quantize_model`` then makes the experts
    E4M3 again with per-row scales (a per-row checkpoint's codes come back exactly)."""

    def part_of(name: str, tensor: torch.Tensor) -> tuple[str, str] | str | None:
        layer = name.rsplit(".", 1)[0]
        if f"{layer}.weight" not in expert_names:
            return None
        if name.endswith((".input_scale", *_DROPPED_SUFFIXES)):
            return _DROP
        return layer, "codes" if name.endswith(".weight") else "scale"

    def join(layer: str, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if scale.numel() not in (1, codes.shape[0]):
            raise _unsupported(f"{tuple(scale.shape)} scales for {layer}.weight")
        return codes.float() * scale.reshape(-1, 1)

    return _join_codes_and_scales(weights, part_of, join)


def _expand_scales(
    weights: Iterable[tuple[str, torch.Tensor]],
    rows_of: dict[str, int],
    static_input_scales: bool,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each weight scale as float32 ``[rows]`` of its weight."""
    for name, tensor in weights:
        if name.endswith(_DROPPED_SUFFIXES) or (
            name.endswith(".input_scale") and not static_input_scales
        ):
            continue
        if name.endswith(".weight_scale"):
            rows = rows_of.get(name.removesuffix("_scale"))
            if rows is None:
                raise ValueError(
                    f"the FP8 checkpoint has {name} but no {name.removesuffix('_scale')}; "
                    "it is incomplete (download it again)."
                )
            if tensor.numel() == 1:
                tensor = tensor.reshape(1).expand(rows)
            elif tensor.numel() != rows:
                raise _unsupported(f"{tuple(tensor.shape)} scales for {rows} rows ({name})")
            tensor = tensor.float().reshape(rows)
        yield name, tensor


def prepare_fp8_checkpoint(
    model: nn.Module,
    scheme: Fp8CheckpointScheme,
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Give the layers the checkpoint stores in E4M3 their quantized parameters; returns the
    weight stream to feed ``model.load_weights``. ``shapes``: HF name -> (shape, dtype) of
    every tensor, from the files' headers."""
    layers, expert_names = _fp8_layers(model, shapes)
    for layer in layers:
        add_fp8_parameters(layer, scheme.static_input_scales)
    logger.info(
        "FP8 checkpoint (%s): %d linear layers in E4M3, %d expert tensors (re-quantized per "
        "row after loading)",
        scheme.method,
        len(layers),
        len(expert_names),
    )
    rows_of = {name: spec[0][0] for name, spec in shapes.items() if name.endswith(".weight")}
    weights = _dequantize_experts(weights, expert_names)
    return _expand_scales(weights, rows_of, scheme.static_input_scales)


def dequantize_blocks(
    weights: Iterable[tuple[str, torch.Tensor]], block_size: tuple[int, int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream of a block-scaled FP8 checkpoint with each E4M3 ``<layer>.weight`` and
    its ``<layer>.weight_scale_inv`` joined into the float32 weight ``codes * scale`` (the
    scale of the block each element is in; edge blocks may be partial), exactly; every
    other tensor as it is."""
    rows_per_block, cols_per_block = block_size

    def part_of(name: str, tensor: torch.Tensor) -> tuple[str, str] | str | None:
        if name.endswith(".weight_scale_inv"):
            return name.removesuffix(".weight_scale_inv"), "scale"
        if name.endswith(".weight") and tensor.dtype == FP8_DTYPE:
            return name.removesuffix(".weight"), "codes"
        return _DROP if name.endswith(_DROPPED_SUFFIXES) else None

    def join(layer: str, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        rows, cols = codes.shape
        expected = (-(-rows // rows_per_block), -(-cols // cols_per_block))
        if tuple(scale.shape) != expected:
            raise _unsupported(
                f"{tuple(scale.shape)} block scales for {layer}.weight {rows}x{cols}"
            )
        scale = scale.repeat_interleave(rows_per_block, 0)[:rows]
        return codes.float() * scale.repeat_interleave(cols_per_block, 1)[:, :cols]

    return _join_codes_and_scales(weights, part_of, join)


__all__ = [
    "FP8_CHECKPOINT_METHODS",
    "Fp8CheckpointScheme",
    "dequantize_blocks",
    "fp8_checkpoint_scheme",
    "prepare_fp8_checkpoint",
]
