"""Llama-family models loaded by load_model against transformers, on tiny random checkpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from model_utils import PagedRunner
from pagedlm.model_executor.loader import load_model
from tiny_checkpoints import (
    PROMPT_LENS,
    SMALL,
    model_config,
    random_prompts,
    save_random_model,
    save_with_reference_logits,
)

BLOCK_SIZE = 4
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 50000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so that positions < 40 reach the scaled and the interpolated frequencies.
    "original_max_position_embeddings": 16,
}

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "llama_tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    "llama3_rope": ("LlamaConfig", {"rope_parameters": LLAMA3_ROPE}),
    "llama3_rope_tied": (
        "LlamaConfig",
        {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True, "num_hidden_layers": 3},
    ),
    "llama_linear_rope_biases": (
        "LlamaConfig",
        {
            "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
            "attention_bias": True,
            "mlp_bias": True,
        },
    ),
    "mistral": ("MistralConfig", {"sliding_window": None, "head_dim": 32}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": False}),
}


def prefill_all(model: torch.nn.Module, prompts: list[list[int]]) -> torch.Tensor:
    """Every prompt in one step: float32 logits of every token [T, vocab]."""
    runner = PagedRunner(model, len(prompts), max(map(len, prompts)), BLOCK_SIZE)
    return torch.cat(runner.step([(i, 0, p) for i, p in enumerate(prompts)]))


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(request.param)
    return path, *save_with_reference_logits(path, *CASES[request.param])


def test_one_step_matches_transformers(checkpoint) -> None:
    path, prompts, expected = checkpoint
    config = model_config(path)
    logits = prefill_all(load_model(config, torch.device("cpu")), prompts)
    assert logits.dtype == torch.float32
    assert logits.shape == (sum(PROMPT_LENS), SMALL["vocab_size"])
    torch.testing.assert_close(logits, torch.cat(expected), atol=1e-4, rtol=0)
    last_rows = torch.tensor(PROMPT_LENS).cumsum(0) - 1
    last = torch.stack([e[-1] for e in expected])
    torch.testing.assert_close(logits[last_rows], last, atol=1e-4, rtol=0)


def test_two_steps_read_the_cache(checkpoint) -> None:
    """First step: a prefix of every prompt; second: the rest (1 token for some: decodes)."""
    path, prompts, expected = checkpoint
    config = model_config(path)
    model = load_model(config, torch.device("cpu"))
    runner = PagedRunner(model, len(prompts), max(PROMPT_LENS), BLOCK_SIZE)
    split = [max(1, n - 1) if n <= 7 else n // 2 + 1 for n in PROMPT_LENS]
    got = runner.step([(i, 0, p[:s]) for i, (p, s) in enumerate(zip(prompts, split, strict=True))])
    rest = [
        (i, s, p[s:]) for i, (p, s) in enumerate(zip(prompts, split, strict=True)) if s < len(p)
    ]
    for (i, _, _), logits in zip(rest, runner.step(rest), strict=True):
        got[i] = torch.cat([got[i], logits])
    torch.testing.assert_close(torch.cat(got), torch.cat(expected), atol=1e-4, rtol=0)


def test_bfloat16_load_stays_close(tmp_path: Path) -> None:
    save_random_model(tmp_path, "Qwen3Config", {"head_dim": 32})
    prompts = random_prompts()
    outputs = {}
    for dtype in (torch.float32, torch.bfloat16):
        config = model_config(tmp_path, dtype=dtype)
        model = load_model(config, torch.device("cpu"))
        assert {p.dtype for p in model.parameters()} == {dtype}
        outputs[dtype] = prefill_all(model, prompts)
    assert torch.get_default_dtype() == torch.float32
    assert outputs[torch.bfloat16].dtype == torch.float32
    torch.testing.assert_close(
        outputs[torch.bfloat16], outputs[torch.float32], atol=0.15, rtol=0.05
    )


def test_old_and_new_config_spellings_give_the_same_model(tmp_path: Path) -> None:
    save_random_model(tmp_path, "LlamaConfig", {"rope_parameters": LLAMA3_ROPE})
    config_file = tmp_path / "config.json"
    new = json.loads(config_file.read_text())
    assert "rope_parameters" in new and "dtype" in new  # what transformers 5 writes
    old = dict(new)
    rope = dict(old.pop("rope_parameters"))
    old["rope_theta"] = rope.pop("rope_theta")
    old["rope_scaling"] = rope
    old["torch_dtype"] = old.pop("dtype")

    prompts = random_prompts()
    logits = {}
    for name, spelling in (("new", new), ("old", old)):
        config_file.write_text(json.dumps(spelling))
        config = model_config(tmp_path)
        assert config.arch.rope_theta == LLAMA3_ROPE["rope_theta"]
        assert config.arch.rope_scaling is not None
        logits[name] = prefill_all(load_model(config, torch.device("cpu")), prompts)
    torch.testing.assert_close(logits["old"], logits["new"], atol=0, rtol=0)
