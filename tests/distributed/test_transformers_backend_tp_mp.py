"""The Transformers modeling backend under tensor parallelism over two worker processes
(gloo): GLM (no pagedlm implementation) split by its own plan, attention by head, its
packed gate/up gathered and the down projection splitting its whole input. The run equals
one worker's, and no process is left."""

from __future__ import annotations

from pathlib import Path

from parity import assert_same_run, one_worker_run, processes_gone, run_and_stop

from tiny_checkpoints import save_random_model

IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def test_two_ranks_run_glm_by_its_plan(tmp_path: Path) -> None:
    save_random_model(tmp_path, "GlmConfig", {"head_dim": 16, "partial_rotary_factor": 0.5, **IDS})
    reference = one_worker_run(tmp_path)
    outputs, pids = run_and_stop(tmp_path, tensor_parallel_size=2)
    assert_same_run(outputs, reference)
    assert len(pids) == 2 and processes_gone(pids)
