"""A GPTQ checkpoint over two tensor-parallel worker processes (gloo): each rank routes its
shard of the layers' integer blocks (a group straddling the ranks split at 32 columns)
and the run matches one worker's."""

from __future__ import annotations

from dataclasses import replace

from parity import assert_same_run, one_worker_run, processes_gone, run_and_stop

from loader.test_int_checkpoint import CASES, _write_quantized


def test_two_tensor_parallel_ranks_on_gptq_blocks(tmp_path):
    # Groups of 64: o_proj's 64 inputs split 32 per rank, down_proj's 128 split 64.
    _write_quantized(tmp_path, replace(CASES["gptq_asym_v2"], group_size=64, intermediate_size=128))
    reference = one_worker_run(tmp_path)
    outputs, pids = run_and_stop(tmp_path, tensor_parallel_size=2)
    assert len(pids) == 2 and processes_gone(pids)
    # Partial sums add in another order; a rank with the wrong shard of its blocks is far off.
    worst = assert_same_run(outputs, reference, tolerance=1e-4)
    print(f"GPTQ, TP=2 against one worker: prompt logprob difference max {worst:.2e}")
