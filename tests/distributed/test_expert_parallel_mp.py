"""Expert parallelism: two ranks holding three whole experts each of a tiny Qwen3-MoE give
one worker's tokens."""

from __future__ import annotations

from parity import assert_same_run, greedy_run, make_llm, run_and_stop


def test_experts_sharded_over_two_ranks(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    reference = make_llm(path)
    try:
        expected = greedy_run(reference)
    finally:
        reference.llm_engine.shutdown()
    outputs, _ = run_and_stop(path, tensor_parallel_size=2, enable_expert_parallel=True)
    assert_same_run(outputs, expected)
