"""A sharded PyTorch .bin checkpoint under tensor parallelism over two worker processes
(gloo): each rank reads the shards as plain tensors and keeps its slices; the run equals
one worker's on the safetensors checkpoint, and no process is left."""

from __future__ import annotations

import shutil
from pathlib import Path

from huggingface_hub import save_torch_state_dict
from parity import assert_same_run, processes_gone, run_and_stop
from safetensors.torch import load_file


def test_two_ranks_load_bin_shards(llama: Path, llama_reference, tmp_path: Path) -> None:
    shutil.copy(llama / "config.json", tmp_path / "config.json")
    state = {k: v for f in sorted(llama.glob("*.safetensors")) for k, v in load_file(f).items()}
    save_torch_state_dict(state, tmp_path, safe_serialization=False, max_shard_size="100KB")
    assert len(list(tmp_path.glob("pytorch_model-*.bin"))) > 1
    assert not list(tmp_path.glob("*.safetensors"))
    outputs, pids = run_and_stop(tmp_path, tensor_parallel_size=2)
    assert_same_run(outputs, llama_reference)
    assert len(pids) == 2 and processes_gone(pids)
