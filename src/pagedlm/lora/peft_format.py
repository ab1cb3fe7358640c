"""PEFT adapter directories: ``adapter_config.json`` + ``adapter_model.safetensors`` (or
PEFT's older ``adapter_model.bin``, or ``.pt``, read as vLLM reads them).

``check_adapter`` validates an adapter against a model's shapes from the config and the
safetensors *header* only (no tensor is read; a pickled file is read whole, with
``torch.load(weights_only=True)``), so the front end can refuse a bad adapter before its
request enters the engine. ``load_adapter`` then reads the tensors, with the
scaling (``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA) folded into B, so
applying an adapter is ``x A^T B^T`` with no per-step scale.

PEFT stores ``base_model.model.<module>.lora_A.weight`` [r, in_features] and
``...lora_B.weight`` [out_features, r] per targeted module.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pagedlm.config import ArchConfig
from pagedlm.lora.targets import MOE_MODULE_NAMES, module_shapes

if TYPE_CHECKING:
    import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
WEIGHTS_FILES = (WEIGHTS_FILE, "adapter_model.bin", "adapter_model.pt")
"""The weights files read, in vLLM's order of preference."""
NOT_FOUND = "No adapter found for"
"""vLLM's words for an adapter path with nothing there (its servers answer 404)."""
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<kind>A|B)\.weight$")
_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True)
class PeftAdapterConfig:
    """What pagedlm reads from ``adapter_config.json``."""

    rank: int
    lora_alpha: float
    use_rslora: bool
    modules: tuple[str, ...]
    """HF module paths the weights file adapts (``model.layers.0.self_attn.q_proj``)."""

    @property
    def scaling(self) -> float:
        root = math.sqrt(self.rank) if self.use_rslora else self.rank
        return self.lora_alpha / root


@dataclass(frozen=True)
class AdapterWeights:
    """One adapter's tensors on the host: module path -> (A [r, in], B [out, r] * scaling)."""

    rank: int
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]


def _files(path: str) -> tuple[Path, Path]:
    directory = Path(path).expanduser()
    if not directory.is_dir() or not (directory / CONFIG_FILE).is_file():
        what = (
            "has no " + CONFIG_FILE
            if directory.is_dir()
            else "does not exist or is not a directory"
        )
        raise ValueError(
            f"{NOT_FOUND} {path!r}: the path {what}; pass a local PEFT adapter directory "
            f"({CONFIG_FILE} + {WEIGHTS_FILE})."
        )
    for name in WEIGHTS_FILES:
        if (directory / name).is_file():
            return directory / CONFIG_FILE, directory / name
    raise ValueError(f"LoRA adapter {path!r} has no {' or '.join(WEIGHTS_FILES)}.")


def _unreadable(path: str, file: Path, error: Exception) -> ValueError:
    return ValueError(
        f"LoRA adapter {path!r}: {file.name} cannot be read ({error}); save the adapter again."
    )


def _tensor_shapes(path: str, file: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a weights file (a safetensors file's header only)."""
    if file.suffix != ".safetensors":
        return {key: tuple(tensor.shape) for key, tensor in _read_tensors(path, file).items()}
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as tensors:
            return {key: tuple(tensors.get_slice(key).get_shape()) for key in tensors.keys()}  # noqa: SIM118
    except (SafetensorError, OSError) as error:  # a truncated or corrupted file
        raise _unreadable(path, file, error) from None


def _read_tensors(path: str, file: Path) -> dict[str, torch.Tensor]:
    import torch

    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(file), device="cpu")
        # weights_only: tensors and containers, never arbitrary objects (vLLM's call).
        tensors = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # pickle, zip and safetensors each raise their own
        raise _unreadable(path, file, error) from None
    if not isinstance(tensors, dict) or not all(
        isinstance(key, str) and isinstance(value, torch.Tensor) for key, value in tensors.items()
    ):
        raise ValueError(f"LoRA adapter {path!r}: {file.name} is not a dict of named tensors.")
    return tensors


def _read_config(file: Path, max_lora_rank: int) -> dict:
    try:
        raw = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {file}: {exc}") from None
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{file}: peft_type {raw['peft_type']!r} is not LORA.")
    unsupported = {
        "use_dora": "DoRA adapters",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D) adapters",
        "modules_to_save": "modules_to_save (fully trained extra modules)",
        "rank_pattern": "rank_pattern (per-module ranks)",
        "alpha_pattern": "alpha_pattern (per-module alphas)",
    }
    for key, what in unsupported.items():
        if raw.get(key):
            raise ValueError(f"{file}: {what} are not supported ({key}={raw[key]!r}).")
    if raw.get("bias", "none") != "none":
        raise ValueError(f"{file}: LoRA bias={raw['bias']!r} is not supported; use 'none'.")
    rank = raw.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{file}: r must be a positive integer, got {rank!r}.")
    alpha = raw.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        # vLLM requires it too; PEFT writes it always. Guessing a default would scale the
        # whole delta wrongly without a word.
        raise ValueError(f"{file}: lora_alpha must be a number, got {alpha!r}.")
    if rank > max_lora_rank:
        raise ValueError(
            f"LoRA rank {rank} is greater than max_lora_rank {max_lora_rank}; start the "
            f"engine with --max-lora-rank {rank} (max_lora_rank={rank}) or higher."
        )
    return raw


def _renames(arch: ArchConfig, model_impl: str) -> tuple[tuple[str, str], ...]:
    from pagedlm.model_executor.models.registry import get_model_class

    return getattr(get_model_class(arch.architecture, model_impl), "hf_renames", ())


def _our_module(module: str, arch: ArchConfig, model_impl: str) -> str:
    """An adapter's module path in the model's own names: the architecture's checkpoint
    renames applied (Phi's ``self_attn.dense`` is its ``o_proj``, ``mlp.fc1`` its
    ``fc_in``), as ``load_weights`` applies them to the base model's tensors."""
    name = f".{module}."
    for theirs, ours in _renames(arch, model_impl):
        name = name.replace(theirs, ours)
    return name[1:-1]


def layer_index(module: str) -> int | None:
    """The decoder layer an adapter module belongs to (``model.layers.3.mlp.up_proj`` -> 3)."""
    match = _LAYER.search(f".{module}.")
    return None if match is None else int(match.group(1))


def _check_module(module: str, arch: ArchConfig, shapes: dict[str, tuple[int, int]]) -> str:
    """The projection name of ``module``, after refusing what the model lacks."""
    parts = module.split(".")
    if any(part in MOE_MODULE_NAMES for part in parts):
        raise ValueError(
            f"LoRA adapters for MoE experts ({module}) are not supported; adapt the "
            "attention projections only."
        )
    leaf = parts[-1]
    layer = _LAYER.search(f".{module}.")
    if leaf not in shapes or layer is None or int(layer.group(1)) >= arch.num_hidden_layers:
        raise ValueError(
            f"LoRA target module {module!r} does not exist in {arch.architecture} "
            f"({arch.num_hidden_layers} layers); supported target modules: "
            f"{', '.join(sorted(shapes))}."
        )
    return leaf


def check_adapter(
    path: str, arch: ArchConfig, max_lora_rank: int, model_impl: str = "vllm"
) -> PeftAdapterConfig:
    """Validate ``path`` for ``arch`` without reading tensors; raises ValueError naming
    the problem (missing files, rank above ``max_lora_rank``, a module the model lacks, a
    shape of another base model, MoE experts)."""
    config_file, weights_file = _files(path)
    raw = _read_config(config_file, max_lora_rank)
    rank = raw["r"]
    # The tensors say what the adapter adapts, not ``target_modules``: PEFT trains with
    # entries that match no module of the model, and vLLM serves such adapters.
    shapes = module_shapes(arch, model_impl)
    found: dict[str, set[str]] = {}
    for key, shape in _tensor_shapes(path, weights_file).items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(
                f"LoRA adapter {path!r}: tensor {key!r} is not a lora_A/lora_B weight "
                "(embedding, bias or DoRA tensors are not supported)."
            )
        module, kind = _our_module(match["module"], arch, model_impl), match["kind"]
        in_features, out_features = shapes[_check_module(module, arch, shapes)]
        expected = (rank, in_features) if kind == "A" else (out_features, rank)
        if shape != expected:
            raise ValueError(
                f"LoRA adapter {path!r}: {key} has shape {list(shape)} but "
                f"{arch.architecture} with r={rank} needs {list(expected)}; the adapter "
                "was trained for another base model."
            )
        found.setdefault(module, set()).add(kind)
    incomplete = sorted(m for m, kinds in found.items() if kinds != {"A", "B"})
    if incomplete:
        raise ValueError(f"LoRA adapter {path!r}: {incomplete[0]} lacks lora_A or lora_B.")
    if not found:
        raise ValueError(f"LoRA adapter {path!r} has no LoRA tensors.")
    return PeftAdapterConfig(
        rank=rank,
        lora_alpha=float(raw["lora_alpha"]),
        use_rslora=bool(raw.get("use_rslora", False)),
        modules=tuple(sorted(found)),
    )


def load_adapter(
    path: str, arch: ArchConfig, max_lora_rank: int, model_impl: str = "vllm"
) -> AdapterWeights:
    """Check, then read the adapter's tensors (float32, host), B scaled."""
    import torch

    config = check_adapter(path, arch, max_lora_rank, model_impl)
    tensors = _read_tensors(path, _files(path)[1])
    modules = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        assert match is not None, "check_adapter accepted every key"
        if match["kind"] == "A":
            module = _our_module(match["module"], arch, model_impl)
            lora_b = tensors[key[: -len("lora_A.weight")] + "lora_B.weight"]
            modules[module] = (
                tensor.to(torch.float32),
                lora_b.to(torch.float32) * config.scaling,
            )
    return AdapterWeights(config.rank, modules)
