"""PyTorch .bin/.pt checkpoints (load_format "pt", and "auto" on a directory without
safetensors): the same model as the safetensors checkpoint they were written from, a
trainer's files never read, nothing unpickled but tensors, and errors that name the fix.

transformers 5 always writes safetensors (its ``safe_serialization=False`` is ignored), so
the .bin files are written by ``huggingface_hub.save_torch_state_dict``, which uses
transformers' names and index layout (``pytorch_model-00001-of-00003.bin`` +
``pytorch_model.bin.index.json``).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from huggingface_hub import save_torch_state_dict
from safetensors.torch import load_file

from pagedlm import LLM, SamplingParams
from pagedlm.config import ArchConfig, ModelConfig
from pagedlm.distributed import parallel_state
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.model_executor.loader import load_model
from pagedlm.model_executor.loader.weight_files import (
    PYTORCH_INDEX_FILE,
    checkpoint_files,
    pickle_weight_names,
)

TINY = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip
PROMPTS = [[5, 9, 2, 77, 31, 8], [42], list(range(3, 30))]
TRAINER_FILES = ("training_args.bin", "optimizer.pt", "optimizer.bin", "scheduler.pt", "scaler.pt")


def safetensors_state(directory: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


def write_pickles(source: Path, target: Path, **save_kwargs) -> Path:
    """``source``'s config and safetensors weights, as PyTorch .bin files in ``target``."""
    target.mkdir(parents=True, exist_ok=True)
    shutil.copy(source / "config.json", target / "config.json")
    state = safetensors_state(source)
    save_torch_state_dict(state, target, safe_serialization=False, **save_kwargs)
    return target


class Planted:
    """Pickled with a call that leaves a file behind; ``weights_only`` must refuse it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("torch-bin")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    model.save_pretrained(root / "safetensors")
    made = {"safetensors": root / "safetensors"}
    made["single"] = write_pickles(made["safetensors"], root / "single")
    made["sharded"] = write_pickles(made["safetensors"], root / "sharded", max_shard_size="20KB")
    return made


def load(path: Path, load_format: str = "auto") -> torch.nn.Module:
    arch = ArchConfig.from_directory(path)
    config = ModelConfig(str(path), None, arch, torch.float32, 64, load_format=load_format)
    return load_model(config, torch.device("cpu"))


def assert_same_parameters(got: torch.nn.Module, want: torch.nn.Module) -> None:
    expected = dict(want.named_parameters())
    actual = dict(got.named_parameters())
    assert actual.keys() == expected.keys()
    for name, param in actual.items():
        assert torch.equal(param, expected[name]), name


def greedy_run(path: Path, load_format: str) -> list[tuple[list[int], list[float]]]:
    llm = LLM(str(path), load_format=load_format, skip_tokenizer_init=True,
              num_kv_blocks=32, max_model_len=64, dtype="float32")  # fmt: skip
    try:
        params = SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=0, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    return [
        (
            list(out.outputs[0].token_ids),
            [out.prompt_logprobs[i][t].logprob for i, t in enumerate(out.prompt_token_ids) if i],
        )
        for out in outputs
    ]


@pytest.fixture(scope="module")
def reference_run(checkpoints: dict[str, Path]):
    return greedy_run(checkpoints["safetensors"], "auto")


def test_sharded_files_follow_the_index(checkpoints: dict[str, Path]) -> None:
    sharded = checkpoints["sharded"]
    shards = sorted(sharded.glob("pytorch_model-*.bin"))
    assert len(shards) >= 3 and (sharded / PYTORCH_INDEX_FILE).is_file()
    files = checkpoint_files(sharded, "auto")
    assert files.format == "pt" and files.fell_back and list(files.files) == shards
    assert not checkpoint_files(sharded, "pt").fell_back


@pytest.mark.parametrize("kind", ["single", "sharded"])
@pytest.mark.parametrize("load_format", ["auto", "pt"])
def test_pickles_give_the_safetensors_model(checkpoints, reference_run, kind, load_format):
    assert_same_parameters(load(checkpoints[kind], load_format), load(checkpoints["safetensors"]))
    assert greedy_run(checkpoints[kind], load_format) == reference_run


def test_a_changed_tensor_changes_the_run(checkpoints, reference_run, tmp_path: Path) -> None:
    """The comparison above can fail: one tensor of the .bin scaled gives another run."""
    state = safetensors_state(checkpoints["safetensors"])
    state["model.layers.1.mlp.down_proj.weight"] *= 3
    shutil.copy(checkpoints["safetensors"] / "config.json", tmp_path)
    torch.save(state, tmp_path / "pytorch_model.bin")
    assert greedy_run(tmp_path, "pt") != reference_run


def test_auto_says_it_falls_back(checkpoints, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="pagedlm.model_executor.loader"):
        load(checkpoints["sharded"])
    assert "has no safetensors weights; load_format='auto' falls back" in caplog.text
    assert "pytorch_model-00001-of-" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagedlm.model_executor.loader"):
        load(checkpoints["sharded"], "pt")
        load(checkpoints["safetensors"])
    assert "falls back" not in caplog.text


def test_safetensors_win_under_auto_and_pt_reads_the_bin(checkpoints, tmp_path: Path) -> None:
    """A directory with both: "auto" reads the safetensors, "pt" the .bin (here other weights)."""
    shutil.copytree(checkpoints["safetensors"], tmp_path, dirs_exist_ok=True)
    state = safetensors_state(tmp_path)
    torch.save({name: value + 1 for name, value in state.items()}, tmp_path / "pytorch_model.bin")
    weight = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(load(tmp_path).get_parameter(weight), state[weight])
    assert torch.equal(load(tmp_path, "pt").get_parameter(weight), state[weight] + 1)


@pytest.mark.parametrize("weights_name", ["pytorch_model.bin", "model.bin", "model.pt"])
def test_trainer_files_are_never_read(checkpoints, tmp_path: Path, weights_name: str) -> None:
    shutil.copy(checkpoints["safetensors"] / "config.json", tmp_path)
    torch.save(safetensors_state(checkpoints["safetensors"]), tmp_path / weights_name)
    marker = tmp_path / "unpickled"
    for name in TRAINER_FILES:  # each would fail the load (and leave the marker) if read
        torch.save({"state": Planted(marker)}, tmp_path / name)
    assert [f.name for f in checkpoint_files(tmp_path, "auto").files] == [weights_name]
    assert_same_parameters(load(tmp_path), load(checkpoints["safetensors"]))
    assert not marker.exists()


def test_pt_files_and_the_legacy_format(checkpoints, tmp_path: Path) -> None:
    """``*.pt`` weights (vLLM's "pt" glob) where there is no .bin, and a file in torch's
    pre-1.6 format (not a zip, so read without a memory map)."""
    shutil.copy(checkpoints["safetensors"] / "config.json", tmp_path)
    state = safetensors_state(checkpoints["safetensors"])
    torch.save(state, tmp_path / "model.pt", _use_new_zipfile_serialization=False)
    torch.save({}, tmp_path / "optimizer.pt")
    assert [f.name for f in checkpoint_files(tmp_path, "pt").files] == ["model.pt"]
    assert_same_parameters(load(tmp_path, "pt"), load(checkpoints["safetensors"]))


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (["pytorch_model.bin", "training_args.bin", "optimizer.pt"], ["pytorch_model.bin"]),
        (["pytorch_model-00002-of-00002.bin", "pytorch_model-00001-of-00002.bin", "x.pt"],
         ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]),
        (["model.bin", "adapter_model.bin", "optimizer.bin", "consolidated.pt"], ["model.bin"]),
        (["consolidated.pt", "scheduler.pt", "scaler.pt", "rng_state.pth"], ["consolidated.pt"]),
        (["training_args.bin", "optimizer.pt", "model.safetensors", "sub/pytorch_model.bin"], []),
    ],
)  # fmt: skip
def test_which_pickle_files_are_weights(names: list[str], expected: list[str]) -> None:
    assert pickle_weight_names(names) == expected


def _engine_config(path: Path, load_format: str = "auto") -> None:
    EngineArgs(model=str(path), load_format=load_format).create_engine_config()


def test_formats_that_find_no_weights_name_the_fix(checkpoints, tmp_path: Path) -> None:
    shutil.copy(checkpoints["safetensors"] / "config.json", tmp_path)
    for name in TRAINER_FILES:
        torch.save({}, tmp_path / name)
    with pytest.raises(ValueError, match=r"has no weights: no \*\.safetensors files and no "):
        _engine_config(tmp_path)
    with pytest.raises(
        ValueError, match=r"load_format='pt' reads PyTorch weight files.*has none\.$"
    ):
        _engine_config(tmp_path, "pt")
    with pytest.raises(ValueError, match=r"has no \*\.safetensors files"):
        _engine_config(tmp_path, "safetensors")
    with pytest.raises(ValueError, match=r"has none \(it has \*\.safetensors files: use "):
        _engine_config(checkpoints["safetensors"], "pt")
    with pytest.raises(ValueError, match=r"has PyTorch \.bin/\.pt weights only; use load_format="):
        _engine_config(checkpoints["single"], "safetensors")
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"load_format='pt' needs a model directory"):
        _engine_config(gguf, "pt")


def test_an_index_naming_a_missing_shard(checkpoints, tmp_path: Path) -> None:
    shutil.copytree(checkpoints["sharded"], tmp_path, dirs_exist_ok=True)
    last = sorted(tmp_path.glob("pytorch_model-*.bin"))[-1]
    last.unlink()
    with pytest.raises(ValueError, match=f"lists shard files that are not in .*: {last.name}"):
        _engine_config(tmp_path)


def test_a_pre_quantized_pickle_is_refused_at_start_up(checkpoints, tmp_path: Path) -> None:
    shutil.copytree(checkpoints["single"], tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"pre-quantized checkpoint in PyTorch \.bin/\.pt files"):
        _engine_config(tmp_path)


def test_anything_but_tensors_is_refused_unrun(checkpoints, tmp_path: Path) -> None:
    shutil.copy(checkpoints["safetensors"] / "config.json", tmp_path)
    marker = tmp_path / "unpickled"
    state = safetensors_state(checkpoints["safetensors"])
    torch.save({**state, "lm_head.weight": Planted(marker)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin cannot be read as plain weights.*"
                                         r"Convert the checkpoint to safetensors"):  # fmt: skip
        load(tmp_path)
    assert not marker.exists()
    torch.save({**state, "step": 3}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"its entry 'step' is a int, not a tensor"):
        load(tmp_path)
    torch.save(list(state.values()), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"holds a list, not a mapping"):
        load(tmp_path)


@pytest.mark.parametrize(
    ("arch", "expert_parallel"),
    [("llama", False), ("phi3_longrope", False), ("mixtral", False), ("mixtral", True),
     ("gpt2", False)],
)  # fmt: skip
def test_tensor_parallel_ranks_slice_plain_tensors(
    tiny_checkpoint, tmp_path: Path, arch: str, expert_parallel: bool
) -> None:
    """Under tensor parallelism the .bin loader hands the weight loaders plain tensors:
    each rank's parameters equal those it reads from the safetensors slices."""
    safetensors = tiny_checkpoint(arch)
    pickles = write_pickles(safetensors, tmp_path / "bin", max_shard_size="50KB")
    previous = parallel_state.expert_parallel_enabled()
    parallel_state.set_expert_parallel(expert_parallel)
    try:
        for rank in range(2):
            with parallel_state.tensor_model_parallel_state(rank, 2):
                assert_same_parameters(load(pickles, "pt"), load(safetensors))
    finally:
        parallel_state.set_expert_parallel(previous)


def test_shards_are_read_one_at_a_time(checkpoints, monkeypatch) -> None:
    """A shard is loaded whole by torch, so the next one is opened only once every tensor of
    the one before has been handed on (and the loader has dropped it)."""
    from pagedlm.model_executor.loader.torch_bin import iter_torch_bin_weights

    files = checkpoint_files(checkpoints["sharded"], "pt").files
    opened: list[str] = []
    real_load = torch.load

    def counting_load(path, *args, **kwargs):
        opened.append(Path(path).name)
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(torch, "load", counting_load)
    per_shard = [len(real_load(f, weights_only=True)) for f in files]
    opened.clear()
    weights = iter_torch_bin_weights(files)
    for shard, count in enumerate(per_shard):
        for _ in range(count):
            next(weights)
            assert opened == [f.name for f in files[: shard + 1]]
    assert next(weights, None) is None
