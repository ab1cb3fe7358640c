"""Pipeline parallelism over two stages (gloo): each holds one layer, hidden states and
residuals go stage to stage, the sampled ids come back; the tokens are one worker's."""

from __future__ import annotations

from parity import assert_same_run, processes_gone, run_and_stop


def test_two_pipeline_stages(llama, llama_reference):
    outputs, pids = run_and_stop(llama, pipeline_parallel_size=2)
    assert_same_run(outputs, llama_reference)
    assert len(pids) == 2 and processes_gone(pids)
