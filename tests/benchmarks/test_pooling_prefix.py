"""The pooling prefix-cache benchmark on a tiny classifier: both settings give the same
logits (the timings are never asserted)."""

from __future__ import annotations

from embedding_checkpoints import write_decoder
from pagedlm.benchmarks import pooling_prefix


def test_the_prefix_cache_changes_no_logit(tmp_path):
    write_decoder(tmp_path, "Qwen3Config", "Qwen3ForSequenceClassification", num_labels=1)
    figures = pooling_prefix.main(
        ["--model", str(tmp_path), "--query-len", "40", "--num-docs", "4", "--doc-len", "5",
         "--dtype", "float32", "--max-model-len", "128"]
    )  # fmt: skip
    assert figures["max_abs_logit_difference"] < 1e-5
    assert figures["with_prefix_cache_s"] > 0 and figures["without_s"] > 0


def test_a_built_in_shape_becomes_a_one_label_classifier():
    import json
    import os

    path, vocab_size = pooling_prefix.classifier_dir("qwen3-0.6b")
    assert vocab_size == 151936
    with open(os.path.join(path, "config.json")) as file:
        config = json.load(file)
    assert config["architectures"] == ["Qwen3ForSequenceClassification"]
    assert config["num_labels"] == 1
