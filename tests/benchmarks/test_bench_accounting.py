"""Benchmark inputs and speed-of-light accounting (no model is run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedlm.benchmarks.shapes import BUILTIN_SHAPES, resolve_model
from pagedlm.benchmarks.speed_of_light import speed_of_light, weight_params
from pagedlm.benchmarks.throughput import nanovllm_dataset, random_dataset
from pagedlm.config import ArchConfig


def test_nanovllm_dataset_is_nano_vllms() -> None:
    prompts, output_lens = nanovllm_dataset()
    assert len(prompts) == 256 and len(output_lens) == 256
    assert sum(output_lens) == 133_966
    assert all(100 <= len(p) <= 1024 for p in prompts)
    assert all(0 <= t <= 10000 for p in prompts for t in p)


def test_random_dataset_lengths_respect_range_ratio() -> None:
    prompts, outs = random_dataset(50, 100, 20, 0.5)
    assert all(50 <= len(p) <= 150 for p in prompts)
    assert all(10 <= o <= 30 for o in outs)
    fixed, fixed_outs = random_dataset(3, 7, 5, 0.0)
    assert [len(p) for p in fixed] == [7] * 3 and fixed_outs == [5] * 3


@pytest.mark.parametrize("name", sorted(BUILTIN_SHAPES))
def test_builtin_shapes_parse_and_resolve(name: str) -> None:
    directory = Path(resolve_model(name))
    arch = ArchConfig.from_directory(directory)
    assert arch.architecture == BUILTIN_SHAPES[name]["architectures"][0]
    assert json.loads((directory / "config.json").read_text()) == BUILTIN_SHAPES[name]


def test_unknown_model_names_the_builtin_shapes() -> None:
    with pytest.raises(ValueError, match=r"qwen3-0\.6b"):
        resolve_model("no-such-model")


def test_speed_of_light_matches_the_issue_targets() -> None:
    qwen = ArchConfig.from_hf_dict(BUILTIN_SHAPES["qwen3-0.6b"])
    step_params, _ = weight_params(qwen)
    assert 590e6 < step_params < 600e6  # Qwen3-0.6B without its input embedding
    prompts, outs = nanovllm_dataset()
    sol = speed_of_light(qwen, [len(p) for p in prompts], outs)
    assert sum(outs) / sol.seconds == pytest.approx(35_800, rel=0.01)

    llama = ArchConfig.from_hf_dict(BUILTIN_SHAPES["llama-3-8b"])
    sol = speed_of_light(llama, [1024], [256])
    assert sol.weight_bytes == 256 * 2 * weight_params(llama)[0]
    # Weights dominate: ~15 GB a step at 4.3 TB/s, about 280 tok/s.
    assert 270 < 256 / sol.seconds < 290
