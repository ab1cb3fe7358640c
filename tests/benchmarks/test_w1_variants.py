"""The W1-variants benchmark (FP8 KV cache, batch-invariant mode) end to end on a tiny
random model on CPU: every target's figures land in the JSON."""

from __future__ import annotations

import json

import pytest
import transformers

from pagedlm.benchmarks import w1_variants

ENGINE = [
    "--load-format",
    "dummy",
    "--dtype",
    "float32",
    "--max-model-len",
    "128",
    "--max-num-seqs",
    "4",
    "--max-num-batched-tokens",
    "256",
    "--num-kv-blocks",
    "64",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("w1-variants")
    transformers.LlamaConfig(
        vocab_size=10240, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(path)  # fmt: skip
    return str(path)


def test_every_target_lands_in_the_json(model_dir, tmp_path) -> None:
    out = tmp_path / "w1.json"
    w1 = f"--model {model_dir} --dataset random --num-prompts 3 --input-len 8 --output-len 6"
    argv = ["--output-json", str(out), "--in-process", "--w1-args", w1]
    argv += ["--logprobs-model", model_dir, "--logprobs-len", "24", *ENGINE]
    results = w1_variants.main(argv)
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    fp8, invariant, logprobs = results["fp8"], results["batch_invariant"], results["logprobs"]
    assert fp8["flags"] == ["--kv-cache-dtype", "fp8"] and fp8["target"] == "ratio >= 1.35"
    assert fp8["ratio"] > 0 and invariant["ratio"] > 0 and "target" not in invariant
    assert logprobs["tokens"] == 2 * 23
    assert (
        0 < logprobs["max_abs_diff"] < 1.0 and logprobs["mean_abs_diff"] <= logprobs["max_abs_diff"]
    )
