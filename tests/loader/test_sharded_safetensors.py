"""Sharded safetensors: same model as unsharded, clear errors, peak RSS measured while loading."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from pagedlm.config import ArchConfig, ModelConfig
from pagedlm.model_executor.loader import load_model
from pagedlm.model_executor.loader.safetensors_loader import (
    INDEX_FILE,
    iter_safetensors_weights,
    read_safetensors_header,
)

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def save_llama(path: Path, max_shard_size: str | None = None) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def load(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    arch = ArchConfig.from_directory(path)
    return load_model(ModelConfig(str(path), None, arch, dtype, 64), torch.device("cpu"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    single, sharded = tmp_path_factory.mktemp("single"), tmp_path_factory.mktemp("sharded")
    save_llama(single)
    save_llama(sharded, max_shard_size="20KB")
    return single, sharded


def test_sharded_checkpoint_loads_identically(checkpoints: tuple[Path, Path]) -> None:
    single, sharded = checkpoints
    shards = sorted(sharded.glob("*.safetensors"))
    assert len(shards) >= 3 and (sharded / INDEX_FILE).is_file()
    one, many = load(single), load(sharded)
    assert one.state_dict().keys() == many.state_dict().keys()
    for name, tensor in one.state_dict().items():
        assert torch.equal(tensor, many.state_dict()[name]), name


def test_reader_yields_exactly_what_safetensors_holds(tmp_path: Path) -> None:
    torch.manual_seed(0)
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),
        "c": torch.randn(2, 2, 2).half(),
        "d": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "scalar": torch.tensor(2.5),
    }
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    got = dict(iter_safetensors_weights(tmp_path))
    assert got.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_shard_listed_in_index_but_absent(tmp_path: Path) -> None:
    save_llama(tmp_path, max_shard_size="20KB")
    victim = sorted(tmp_path.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ValueError, match=f"lists shard files that are not in .*{victim.name}"):
        load(tmp_path)


def test_truncated_shard_is_reported(tmp_path: Path) -> None:
    save_llama(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"is truncated .* download it again"):
        read_safetensors_header(weights)


def test_shape_that_does_not_match_the_config(tmp_path: Path) -> None:
    save_llama(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 80}))
    with pytest.raises(ValueError, match=r"shape \(32, 64\) .*does not match its config.json"):
        load(tmp_path)


def test_missing_weight_files_name_the_fixes(tmp_path: Path) -> None:
    transformers.LlamaConfig(**TINY, architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r'no \*.safetensors files.*load_format="dummy"'):
        load(tmp_path)


_PEAK_RSS_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from pagedlm.config import ArchConfig, ModelConfig
    from pagedlm.model_executor.loader import load_model
    # Imported before the baseline: we measure loading, not importing the model's code.
    import pagedlm.model_executor.loader.safetensors_loader
    import pagedlm.model_executor.models.llama

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    path = sys.argv[1]
    arch = ArchConfig.from_directory(path)
    config = ModelConfig(path, None, arch, torch.float32, 64)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = status("VmRSS")
    model = load_model(config, torch.device("cpu"))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"before": before, "peak": status("VmHWM"), "weights": weights}))
    """
)


def test_peak_rss_while_loading_a_sharded_checkpoint(tmp_path: Path) -> None:
    """Peak RSS growth during load_model stays below 1.3x the final weights (~48 MB)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64,
        architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        names = {n: p.shape for n, p in transformers.LlamaForCausalLM(config).named_parameters()}
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(3)]
    for index, (name, shape) in enumerate(names.items()):
        shards[index % 3][name] = torch.randn(shape) * 0.02
    weight_map = {}
    for index, shard in enumerate(shards):
        file_name = f"model-{index + 1:05d}-of-00003.safetensors"
        save_file(shard, tmp_path / file_name)
        weight_map.update(dict.fromkeys(shard, file_name))
    (tmp_path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    del shards

    result = subprocess.run(
        [sys.executable, "-c", _PEAK_RSS_SCRIPT, str(tmp_path)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    growth = (measured["peak"] - measured["before"]) / measured["weights"]
    print(f"peak RSS growth while loading: {growth:.3f}x of {measured['weights'] / 1e6:.1f} MB")
    assert growth <= 1.3, measured
