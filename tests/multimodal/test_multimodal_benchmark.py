"""``python -m pagedlm.benchmarks.multimodal`` on CPU with the tiny shapes of both
families: pagedlm and transformers both run the workload and report their figures
(the H200 runs the real shapes; see the module's docstring)."""

from __future__ import annotations

import argparse
import json

import pytest

from pagedlm.benchmarks.multimodal import add_args, run


@pytest.mark.parametrize("shape", ["tiny", "qwen2.5-vl-tiny"])
def test_benchmark_runs_both_sides_on_cpu(shape, tmp_path) -> None:
    parser = argparse.ArgumentParser()
    add_args(parser)
    out = tmp_path / "out.json"
    args = parser.parse_args(
        ["--shape", shape, "--num-requests", "3", "--output-len", "4", "--encoder-iters", "1"]
        + ["--image-width", "224", "--image-height", "168", "--output-json", str(out)]
    )
    results = run(args)
    for side in ("pagedlm", "transformers"):
        assert results[side]["images_per_s"] > 0
        assert results[side]["output_tok_per_s"] > 0
        assert results[side]["encoder_ms_per_image"] > 0
    assert json.loads(out.read_text())["shape"] == shape
