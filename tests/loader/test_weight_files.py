"""Which files a load reads when a directory holds its weights twice: an index decides where
there is one (vLLM's ``filter_duplicate_safetensors_files``), else the single file beats a
shard set of its name and Mistral's ``consolidated*`` gives way; the load opens only those."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pagedlm.config import ArchConfig, ModelConfig
from pagedlm.model_executor.loader import load_model, safetensors_loader
from pagedlm.model_executor.loader.weight_files import checkpoint_files, choose_weight_names

TINY = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip
SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
BIN_SHARDS = ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]
INDEXED = {"model.safetensors.index.json": SHARDS, "pytorch_model.bin.index.json": BIN_SHARDS}


def read_index(name: str) -> list[str]:
    return INDEXED[name]


@pytest.mark.parametrize(
    ("names", "load_format", "expected"),
    [
        # An index decides: the single file and Mistral's consolidated copy are not read.
        (["model.safetensors", *SHARDS, "model.safetensors.index.json",
          "consolidated.safetensors"], "auto", SHARDS),
        (["pytorch_model.bin", *BIN_SHARDS, "pytorch_model.bin.index.json"], "pt", BIN_SHARDS),
        (["pytorch_model.bin", *BIN_SHARDS, "pytorch_model.bin.index.json"], "auto", BIN_SHARDS),
        # No index: the single file of the shards' name, which transformers reads first.
        (["model.safetensors", *SHARDS], "auto", ["model.safetensors"]),
        (["model.safetensors", *SHARDS], "safetensors", ["model.safetensors"]),
        (["pytorch_model.bin", *BIN_SHARDS, "training_args.bin"], "pt", ["pytorch_model.bin"]),
        (["consolidated.safetensors", "model.safetensors"], "auto", ["model.safetensors"]),
        (["consolidated.safetensors"], "auto", ["consolidated.safetensors"]),
        # Nothing twice: everything is read.
        (SHARDS, "auto", SHARDS),
        (["model-00001-of-00002.safetensors", "other.safetensors"], "auto",
         ["model-00001-of-00002.safetensors", "other.safetensors"]),
    ],
)  # fmt: skip
def test_each_weight_is_read_from_one_file(names, load_format, expected) -> None:
    chosen = choose_weight_names(names, load_format, "the directory", read_index)
    assert list(chosen.names) == expected


def save_tiny(directory: Path) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).save_pretrained(directory)
    return load_file(directory / "model.safetensors")


def add_zeroed_copies(directory: Path, state: dict[str, torch.Tensor]) -> None:
    """A second copy of every weight, zeroed: as two shards and as Mistral's consolidated file."""
    zeros = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
    names = sorted(zeros)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    for file_name, half in zip(SHARDS, halves, strict=True):
        save_file({name: zeros[name] for name in half}, directory / file_name)
    save_file(zeros, directory / "consolidated.safetensors")


def load(directory: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.nn.Module, list[str]]:
    """The model loaded from ``directory`` and the names of the files whose headers it read."""
    opened: list[str] = []
    read_header = safetensors_loader.read_safetensors_header

    def recording(path):
        opened.append(Path(path).name)
        return read_header(path)

    monkeypatch.setattr(safetensors_loader, "read_safetensors_header", recording)
    arch = ArchConfig.from_directory(directory)
    config = ModelConfig(str(directory), None, arch, torch.float32, 64)
    return load_model(config, torch.device("cpu")), opened


def test_a_directory_holding_its_weights_twice_reads_them_once(tmp_path, monkeypatch) -> None:
    """Without an index the single file is read; once an index names the shards, only they
    are (a stale single file and the consolidated copy, zeroed here, are never opened)."""
    state = save_tiny(tmp_path)
    add_zeroed_copies(tmp_path, state)
    assert [path.name for path in checkpoint_files(tmp_path, "auto").files] == ["model.safetensors"]
    model, opened = load(tmp_path, monkeypatch)
    assert opened == ["model.safetensors"]
    weight = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(model.get_parameter(weight), state[weight])

    for file_name in SHARDS:  # the shards get the real weights, the single file the zeros
        real = {name: state[name] for name in load_file(tmp_path / file_name)}
        save_file(real, tmp_path / file_name)
    save_file({n: torch.zeros_like(t) for n, t in state.items()}, tmp_path / "model.safetensors")
    weight_map = {name: f for f in SHARDS for name in load_file(tmp_path / f)}
    index = {"metadata": {}, "weight_map": weight_map}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    model, opened = load(tmp_path, monkeypatch)
    assert opened == SHARDS
    for name in ("model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight"):
        assert torch.equal(model.get_parameter(name), state[name]), name


def test_pickles_without_an_index_read_the_single_file(tmp_path: Path) -> None:
    save_tiny(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    for name in ("pytorch_model.bin", *BIN_SHARDS):
        shutil.copy(tmp_path / "config.json", tmp_path / name)  # names only: not opened here
    files = checkpoint_files(tmp_path, "auto")
    assert files.format == "pt" and [path.name for path in files.files] == ["pytorch_model.bin"]
