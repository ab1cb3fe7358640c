"""Tensor parallelism over two worker processes (gloo) gives one worker's tokens: greedy
continuations identical, teacher-forced prompt logprobs within 1e-5, no process left."""

from __future__ import annotations

from parity import assert_same_run, processes_gone, run_and_stop


def test_two_tensor_parallel_ranks(llama, llama_reference):
    outputs, pids = run_and_stop(llama, tensor_parallel_size=2)
    assert_same_run(outputs, llama_reference)
    assert len(pids) == 2 and processes_gone(pids)
