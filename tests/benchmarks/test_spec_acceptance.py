"""The speculative-decoding benchmark end to end on a tiny random model (CPU): the
acceptance proposer reaches the acceptance length its rate predicts, greedy outputs match
the verification-shaped reference run and no speculation, and the JSON holds every target's figures."""

from __future__ import annotations

import json

import pytest
import transformers

from pagedlm.benchmarks import spec_acceptance

ENGINE = (
    "--load-format dummy --dtype float32 --max-model-len 128 --max-num-seqs 4 "
    "--max-num-batched-tokens 256 --num-kv-blocks 64"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A config only (random weights): a vocabulary wide enough for the prompts' ids."""
    path = tmp_path_factory.mktemp("spec-bench")
    transformers.LlamaConfig(
        vocab_size=10240, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(path)  # fmt: skip
    return str(path)


def test_every_target_lands_in_the_json(model_dir, tmp_path) -> None:
    out = tmp_path / "spec.json"
    acceptance = (
        f"--model {model_dir} {ENGINE} --batch-size 2 --input-len 12 --output-len 24 "
        "--num-iters 1 --num-iters-warmup 0"
    )
    w1 = f"--model {model_dir} {ENGINE} --dataset random --num-prompts 3 --input-len 8 --output-len 8"
    argv = ["--output-json", str(out), "--in-process", "--cases", "1.0:4,0.0:2"]
    results = spec_acceptance.main([*argv, "--acceptance-args", acceptance, "--w1-args", w1])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    always, never = results["acceptance"]["cases"]
    assert always["greedy_identical"] and never["greedy_identical"]
    # On the CPU verification computes decode steps' logits to the bit.
    assert always["plain_common_prefix"] == never["plain_common_prefix"] == 1.0
    assert always["reference_common_prefix"] == never["reference_common_prefix"] == 1.0
    # 24 tokens: the prefill's, then steps of 1 + 4 (the last ones shortened by max_tokens).
    assert always["mean_acceptance_length"] > 4.0
    assert never["mean_acceptance_length"] == 1.0  # every draft corrupted
    assert always["spec_steps"] < results["acceptance"]["plain_steps"] / 3
    assert never["expected_acceptance_length"] == 1.0
    assert results["w1"]["plain_tok_per_s"] > 0 and results["w1"]["spec_tok_per_s"] > 0
