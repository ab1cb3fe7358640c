"""A real 2-process tensor-parallel run (gloo) gives the single-process logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers

from pagedlm.attention.backend import BatchLayout
from pagedlm.config import ArchConfig, ModelConfig
from pagedlm.distributed import destroy_tensor_model_parallel, init_tensor_model_parallel
from pagedlm.kv_cache.interface import TensorKVCache
from pagedlm.model_executor.forward_context import ForwardContext
from pagedlm.model_executor.loader import load_model
from pagedlm_cpu.attention import CpuSdpaBackend

BLOCK_SIZE = 4
PROMPTS = [[5, 9, 2, 77, 31, 8, 100], [42], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]


def paged_logits(model_dir: str, tp_size: int) -> torch.Tensor:
    """One step over PROMPTS with the model sharded ``tp_size`` ways; all-token logits."""
    arch = ArchConfig.from_directory(model_dir)
    config = ModelConfig(model_dir, None, arch, torch.float32, max_model_len=64)
    model = load_model(config, torch.device("cpu"))
    kv_heads_per_rank = max(1, arch.num_key_value_heads // tp_size)
    shape = CpuSdpaBackend.kv_cache_shape(16, BLOCK_SIZE, kv_heads_per_rank, arch.head_dim)
    cache = TensorKVCache(
        shape,
        arch.num_hidden_layers,
        BLOCK_SIZE,
        torch.float32,
        lambda s, d: torch.zeros(s, dtype=d),
    )
    ids, positions, slots, starts, tables = [], [], [], [0], []
    for i, prompt in enumerate(PROMPTS):
        table = [4 * i + j for j in range(4)]
        ids += prompt
        positions += range(len(prompt))
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(len(prompt))]
        starts.append(len(ids))
        tables.append(table)
    layout = BatchLayout.from_lists(starts, [len(p) for p in PROMPTS], tables, slots, BLOCK_SIZE)
    backend = CpuSdpaBackend(torch.device("cpu"))
    ctx = ForwardContext(backend, backend.build_metadata(layout), cache)
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), torch.tensor(positions), ctx))


def _worker(
    rank: int, world_size: int, model_dirs: list[str], init_file: str, out_dir: str
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        init_tensor_model_parallel(rank, world_size)
        for i, model_dir in enumerate(model_dirs):
            torch.save(paged_logits(model_dir, world_size), f"{out_dir}/model{i}-rank{rank}.pt")
    finally:
        destroy_tensor_model_parallel()
        dist.destroy_process_group()


def assert_two_ranks_match_one(model_dirs: list[str], tmp_path: Path, **tolerance) -> None:
    """Each model's logits sharded over two gloo worker processes equal one process's."""
    expected = [paged_logits(model_dir, 1) for model_dir in model_dirs]
    mp.spawn(_worker, args=(2, model_dirs, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    for i, want in enumerate(expected):
        for rank in range(2):
            got = torch.load(tmp_path / f"model{i}-rank{rank}.pt")
            torch.testing.assert_close(got, want, **tolerance)


@pytest.mark.slow
@pytest.mark.parametrize("tie", [False, True])
def test_two_ranks_match_one(tmp_path: Path, tie: bool) -> None:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=251,  # odd, so the last rank's vocabulary shard is padded
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    model_dir = tmp_path / "model"
    transformers.Qwen2ForCausalLM(config).save_pretrained(model_dir)
    assert_two_ranks_match_one([str(model_dir)], tmp_path)
