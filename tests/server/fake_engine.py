"""An engine with ``AsyncLLM``'s interface and no model, for in-process app tests.

Requests go through the real ``InputProcessor`` (every validation the server relies on)
and the real ``OutputProcessor`` (detokenization, stop strings, logprobs); only the
engine core is fake: each step it gives every live request one random token (with
logprob rows when asked) and finishes it after ``num_tokens`` tokens or at its
``max_tokens``. ``step_s`` slows the steps down (shutdown tests).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch

from pagedlm.config import ArchConfig, ModelConfig
from pagedlm.core.outputs import EngineCoreOutput, LogprobsLists
from pagedlm.core.scheduler_interface import SchedulerStats
from pagedlm.engine.health import EngineHealth
from pagedlm.engine.input_processor import InputProcessor
from pagedlm.engine.output_processor import OutputProcessor
from pagedlm.metrics import EngineMetrics
from pagedlm.outputs import RequestOutput
from pagedlm.sampling_params import SamplingParams
from pagedlm.tokenizer import get_tokenizer

IDLE_STATS = SchedulerStats(0, 0, 0.0, 0, 0, 0)


class FakeEngine:
    def __init__(
        self, checkpoint: Path, max_model_len: int = 512, num_tokens: int = 3, step_s: float = 0.0
    ) -> None:
        arch = ArchConfig.from_directory(str(checkpoint))
        config = ModelConfig(str(checkpoint), None, arch, torch.float32, max_model_len)
        self.tokenizer = get_tokenizer(str(checkpoint))
        self.input_processor = InputProcessor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.metrics = EngineMetrics()
        self.num_tokens = num_tokens
        self.step_s = step_s
        self.vocab_size = arch.vocab_size
        self.errored = False
        self._aborted: set[str] = set()
        self._random = random.Random(0)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    async def generate(
        self,
        prompt: Any,
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        lora_request: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        processed = self.input_processor.process(request_id, prompt, params, priority, lora_request)
        children = processed.children
        self.output_processor.add_request(
            request_id,
            processed.prompt,
            processed.prompt_token_ids,
            processed.params,
            [c.request_id for c in children],
            processed.arrival_time,
        )
        step = 0
        try:
            while request_id not in self._aborted:
                await asyncio.sleep(self.step_s)
                if request_id in self._aborted:
                    break
                outputs = [self._step(child.request_id, processed, step) for child in children]
                step += 1
                for output in self.output_processor.process_outputs(outputs).request_outputs:
                    yield output
                    if output.finished:
                        return
        finally:
            self.output_processor.abort_requests([request_id])
            self._aborted.discard(request_id)

    async def beam_search(
        self,
        prompt: Any,
        request_id: str,
        params: Any,
        lora_request: Any = None,
        *,
        generate: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        """``AsyncLLM.beam_search`` over ``generate`` (default: this engine's)."""
        from pagedlm.beam_search import engine_step, request_output, search_async

        text, prompt_ids = self.input_processor.tokenize(prompt)
        config = self.input_processor.model_config
        result = await search_async(
            prompt_ids,
            params,
            engine_step(generate or self.generate, request_id, lora_request),
            set(self.input_processor.eos_token_ids),
            config.max_model_len,
            config.max_logprobs,
        )
        yield request_output(request_id, text, prompt_ids, result, self.tokenizer.decode)

    def _step(self, child_id: str, processed: Any, step: int) -> EngineCoreOutput:
        params = processed.params
        token = self._random.randrange(3, self.vocab_size)
        length = step + 1 >= params.max_tokens
        done = length or step + 1 >= self.num_tokens
        finish = None if not done else ("length" if length else "stop")
        return EngineCoreOutput(
            child_id,
            [token],
            finish_reason=finish,
            new_logprobs=self._rows([token], params.logprobs),
            new_prompt_logprobs=(
                self._rows(processed.prompt_token_ids[1:], params.prompt_logprobs)
                if step == 0
                else None
            ),
        )

    def _rows(self, token_ids: list[int], num_top: int | None) -> LogprobsLists | None:
        if num_top is None or not token_ids:
            return None
        rows = [[t, *range(3, 3 + num_top)] for t in token_ids]
        logprobs = [[-1.0 - i for i in range(len(row))] for row in rows]
        return LogprobsLists(rows, logprobs, [1] * len(rows))

    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)

    async def check_health(self) -> None:
        return None

    async def health(self) -> EngineHealth:
        return EngineHealth("ok", None)

    async def get_scheduler_stats(self) -> SchedulerStats:
        return IDLE_STATS

    async def reset_prefix_cache(self) -> bool:
        return True  # no prefix cache to reset

    def get_metrics(self) -> list:
        return self.metrics.snapshot(IDLE_STATS)

    def shutdown(self) -> None:
        """The app's lifespan calls this; a test client may run it for every call."""


def fake_context(engine: FakeEngine, **fields: Any) -> Any:
    """The routes' ``ServingContext`` over ``engine``, serving it as "tiny"; ``fields``:
    further ``ServingContext`` fields (server flags)."""
    from pagedlm.entrypoints.openai.serving_engine import ServingContext
    from pagedlm.metrics.prometheus import PrometheusMetrics

    return ServingContext(
        engine=engine,
        model_names=["tiny"],
        metrics=PrometheusMetrics("tiny"),
        tokenizer=engine.tokenizer,
        max_model_len=512,
        **fields,
    )


class ScriptedEngine(FakeEngine):
    """Writes ``script`` one token per step, then EOS (the tiny tokenizer has a token per
    byte); keeps every request's parameters."""

    def __init__(self, checkpoint: Path | str, script: str = "") -> None:
        super().__init__(checkpoint, num_tokens=10**6)
        self.script = script
        self.params: list[SamplingParams] = []

    def generate(self, prompt, params, request_id, priority=0, lora_request=None):
        self.params.append(params)
        return super().generate(prompt, params, request_id, priority, lora_request)

    def _step(self, child_id, processed, step):
        from server.server_utils import EOS_ID

        ids = [*self.tokenizer.encode(self.script, add_special_tokens=False), EOS_ID]
        finish = "stop" if step + 1 == len(ids) else None
        return EngineCoreOutput(child_id, [ids[step]], finish_reason=finish)


class AbortingEngine(FakeEngine):
    """Ends every request with finish reason "abort" after ``num_tokens`` tokens, as
    ``pause_generation(mode="abort")`` ends the requests in flight."""

    def _step(self, child_id, processed, step):
        output = super()._step(child_id, processed, step)
        return output._replace(finish_reason="abort") if output.finish_reason else output


def scripted_chat(
    checkpoint: Path | str, script: str, body: dict[str, Any], **fields: Any
) -> tuple[dict[str, Any], str]:
    """The message of a chat completion whose model writes ``script``, and the same
    request's stream (its SSE text); ``fields``: server flags (``ServingContext``)."""
    from starlette.testclient import TestClient

    from pagedlm.entrypoints.openai.app import build_app

    ctx = fake_context(ScriptedEngine(checkpoint, script), **fields)
    with TestClient(build_app(ctx)) as client:
        message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        stream = client.post("/v1/chat/completions", json={**body, "stream": True}).text
    return message, stream
