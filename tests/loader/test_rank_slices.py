"""Tensor-parallel ranks read only their slices of a safetensors checkpoint: the bytes read
are the bytes the rank's parameters hold, and the parameters are those of reading whole
tensors and slicing them."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

from pagedlm.config import ArchConfig, ModelConfig
from pagedlm.distributed import parallel_state
from pagedlm.model_executor.loader import load_model
from pagedlm.model_executor.loader.safetensors_loader import iter_safetensors_weights


class _CountingReads:
    """``os.preadv`` that adds up the bytes it reads."""

    def __init__(self, real):
        self.real, self.nbytes = real, 0

    def __call__(self, fd, buffers, offset):
        count = self.real(fd, buffers, offset)
        self.nbytes += count
        return count


def _load(path, rank: int, expert_parallel: bool) -> torch.nn.Module:
    arch = ArchConfig.from_directory(path)
    config = ModelConfig(str(path), None, arch, torch.float32, 64)
    previous = parallel_state.expert_parallel_enabled()
    parallel_state.set_expert_parallel(expert_parallel)
    try:
        with parallel_state.tensor_model_parallel_state(rank, 2):
            return load_model(config, torch.device("cpu"))
    finally:
        parallel_state.set_expert_parallel(previous)


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize(
    ("arch", "expert_parallel"),
    [
        ("llama", False),
        ("phi3_longrope", False),
        ("mixtral", False),
        ("mixtral", True),
        ("gpt2", False),
    ],
)
def test_rank_reads_only_its_slice(tiny_checkpoint, monkeypatch, arch, expert_parallel):
    path = tiny_checkpoint(arch)
    checkpoint_bytes = sum(os.path.getsize(f) for f in path.glob("*.safetensors"))
    rank = 1  # rank 0's slices start at offset 0, which would hide offset mistakes
    reads = _CountingReads(os.preadv)
    with monkeypatch.context() as patch:
        patch.setattr(os, "preadv", reads)
        sliced = _load(path, rank, expert_parallel)
    with monkeypatch.context() as patch:  # the loader reads whole tensors
        patch.setattr("pagedlm.distributed.get_tensor_model_parallel_world_size", lambda: 1)
        whole = _load(path, rank, expert_parallel)
    expected = dict(whole.named_parameters())
    for name, param in sliced.named_parameters():
        torch.testing.assert_close(param, expected[name], rtol=0, atol=0, msg=name)
    if arch == "gpt2":  # its Conv1D weights are transposed first: read whole
        assert _param_bytes(sliced) < reads.nbytes < checkpoint_bytes
    else:
        assert reads.nbytes == _param_bytes(sliced), (reads.nbytes, _param_bytes(sliced))
        assert reads.nbytes < 0.65 * checkpoint_bytes


def test_slice_reads_the_box_it_was_narrowed_to(tmp_path):
    full = torch.arange(4 * 6 * 5, dtype=torch.float32).reshape(4, 6, 5)
    save_file({"a": full, "b": torch.ones(3, dtype=torch.bfloat16)}, tmp_path / "m.safetensors")
    lazy = dict(iter_safetensors_weights(tmp_path, slices=True))
    a = lazy["a"]
    assert a.shape == full.shape and a.dim() == 3
    torch.testing.assert_close(a.narrow(0, 1, 2).narrow(1, 2, 3).materialize(), full[1:3, 2:5])
    torch.testing.assert_close(a[2:].narrow(2, 1, 3).materialize(), full[2:, :, 1:4])
    torch.testing.assert_close(1 - a.narrow(2, 4, 1) * 2, 1 - full[:, :, 4:] * 2)  # ops read
    torch.testing.assert_close(a.transpose(0, 1), full.transpose(0, 1))
    parts = [p.materialize() for p in a.split([1, 3], dim=0) + a.chunk(3, dim=2)]
    for got, want in zip(parts, full.split([1, 3], dim=0) + full.chunk(3, dim=2), strict=True):
        torch.testing.assert_close(got, want)
    target = torch.empty(3, 5)
    target.copy_(a.narrow(0, 3, 1).narrow(1, 0, 3).reshape(3, 5))
    torch.testing.assert_close(target, full[3, :3])
    assert lazy["b"].materialize().dtype == torch.bfloat16
    with pytest.raises(IndexError, match="outside a"):
        a.narrow(1, 4, 3)
