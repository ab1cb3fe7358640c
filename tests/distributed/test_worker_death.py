"""A worker killed mid-generation fails the waiter within 2 s and leaves no process."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from parity import processes_gone

from pagedlm import LLM, SamplingParams
from pagedlm.executor.distributed import WorkerDiedError

ERROR_WITHIN_S = 2.0


def _wait_until(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("victim", [1, pytest.param(0, marks=pytest.mark.slow)])
def test_killed_worker_fails_generate(llama, victim):
    llm = LLM(
        str(llama),
        skip_tokenizer_init=True,
        tensor_parallel_size=2,
        num_kv_blocks=600,
        max_model_len=1024,
        disable_log_stats=False,
    )
    engine = llm.llm_engine
    pids = list(engine.engine_core.executor.worker_pids)
    outcome: dict[str, object] = {}

    def generate() -> None:
        params = SamplingParams(max_tokens=900, temperature=0, ignore_eos=True)
        try:
            llm.generate([{"prompt_token_ids": [7, 8, 9]}] * 8, params, use_tqdm=False)
        except Exception as error:
            outcome["error"] = error
        outcome["at"] = time.monotonic()

    thread = threading.Thread(target=generate)
    try:
        thread.start()
        # Mid-generation: the requests run and have produced tokens.
        _wait_until(lambda: engine.metrics.generation_tokens > 0, 60)
        killed_at = time.monotonic()
        os.kill(pids[victim], signal.SIGKILL)
        thread.join(timeout=30)
        assert not thread.is_alive()
        assert isinstance(outcome.get("error"), WorkerDiedError), outcome
        assert outcome["at"] - killed_at < ERROR_WITHIN_S
        assert "worker rank" in str(outcome["error"])
    finally:
        engine.shutdown()
    _wait_until(lambda: processes_gone(pids), 10)
