"""Runs one step: flattens the scheduled tokens into one batch, runs the model, samples.

Per step: update per-request state from the SchedulerOutput, build ``input_ids``,
``positions`` and the ``BatchLayout`` (query offsets, sequence lengths, block tables, slot
mapping), let the attention backend build its metadata once, run the model, compute
logits only for rows that are sampled or asked for prompt logprobs, and sample.

A multi-step window (``num_steps`` > 1) is queued without waiting: its steps feed each
other's samples on the device, and ``launch`` returns a ``DecodeWindow`` handle
(``decode_window.py``) whose ``result()`` is the one wait. Any other step runs to the end.

Structured outputs: the scheduler owns the grammar matchers and ships the bitmask of the
constrained requests that sample with the ``SchedulerOutput`` (``grammar_bitmask``, as in
vLLM); the runner only lays its rows out in sampling order and hands it to the sampler.
"""

from __future__ import annotations

import logging
import os

import torch

from pagedlm.attention import AttentionBackend, BatchLayout
from pagedlm.config import EngineConfig
from pagedlm.core.outputs import (
    GrammarBitmask,
    LogprobsLists,
    ModelRunnerOutput,
    SchedulerOutput,
)
from pagedlm.executor.interface import FinishedStep, StepResult
from pagedlm.kv_cache.interface import KVCache, TensorKVCache, kv_bytes_per_block
from pagedlm.model_executor.forward_context import ForwardContext
from pagedlm.model_executor.loader import load_model
from pagedlm.platforms import Platform
from pagedlm.platforms.interface import DecodeGraphRunner
from pagedlm.sample.host_copy import to_device
from pagedlm.sample.metadata import SamplingMetadata
from pagedlm.sample.sampler import Sampler
from pagedlm.worker.decode_window import DecodeWindow, copy_to_host
from pagedlm.worker.prompt_logprobs import PromptLogprobsRows, compute_prompt_logprobs
from pagedlm.worker.request_state import CachedRequestState

logger = logging.getLogger(__name__)

ENFORCE_EAGER_ENV = "PAGEDLM_ENFORCE_EAGER"
"""Set to 1 to never replay decode steps from CUDA graphs (also ``enforce_eager``)."""


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        platform: Platform,
        attn_backend_cls: type[AttentionBackend],
    ) -> None:
        self.config = config
        self.platform = platform
        self.device = platform.device
        self.block_size = config.cache.block_size
        self.arch = config.model.arch
        self.model = load_model(config.model, self.device)
        platform.prepare_model(self.model)
        self.attn_backend = attn_backend_cls(self.device)
        self.sampler = Sampler(fused_random=platform.fused_sampler())
        self.default_generator = torch.Generator(device=self.device)
        self.default_generator.manual_seed(config.model.seed)
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_cache: KVCache | None = None
        self.graph_runner: DecodeGraphRunner | None = None
        self._last_window: tuple[list[str], torch.Tensor] | None = None
        """The latest multi-step window's request ids and last sampled tokens (device)."""
        self.enforce_eager = bool(getattr(config.model, "enforce_eager", False)) or (
            os.environ.get(ENFORCE_EAGER_ENV, "0") not in ("", "0")
        )
        if platform.profiles_memory:
            self.profile_run()

    def profile_run(self) -> None:
        """One forward at the step's largest shape (``max_num_batched_tokens`` tokens, then
        logits for ``max_num_seqs`` rows) over a throwaway KV cache, so the platform sees
        the activation peak before it sizes the real cache."""
        sched = self.config.scheduler
        num_tokens = sched.max_num_batched_tokens
        # As many max_model_len-long prompts as fill the token budget (positions stay
        # within the rotary table).
        lens = [sched.max_model_len] * (num_tokens // sched.max_model_len)
        if num_tokens % sched.max_model_len:
            lens.append(num_tokens % sched.max_model_len)
        bs = self.block_size
        tables, slots, query_start_loc, next_block = [], [], [0], 0
        for n in lens:
            blocks = list(range(next_block, next_block + -(-n // bs)))
            next_block += len(blocks)
            tables.append(blocks)
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(n))
            query_start_loc.append(query_start_loc[-1] + n)
        arch = self.arch
        shape = self.attn_backend.kv_cache_shape(
            next_block, bs, arch.num_key_value_heads, arch.head_dim
        )
        cache = TensorKVCache(
            shape, arch.num_hidden_layers, bs, self.config.model.dtype, self.platform.zeros
        )
        layout = BatchLayout(query_start_loc, lens, tables, slots, bs)
        ctx = ForwardContext(self.attn_backend, self.attn_backend.build_metadata(layout), cache)
        with torch.inference_mode():
            ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
            positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
            hidden = self.model(ids, positions, ctx)
            rows = hidden[: min(sched.max_num_seqs, num_tokens)]
            rows = rows.repeat(-(-sched.max_num_seqs // rows.shape[0]), 1)
            self.model.compute_logits(rows[: sched.max_num_seqs]).softmax(-1)
        self.platform.synchronize()

    # ---- KV cache -------------------------------------------------------------------

    def kv_bytes_per_block(self) -> int:
        arch = self.arch
        return kv_bytes_per_block(
            self.block_size,
            arch.num_hidden_layers,
            arch.num_key_value_heads,
            arch.head_dim,
            self.config.model.dtype,
        )

    def initialize_kv_cache(self, num_blocks: int) -> None:
        arch = self.arch
        shape = self.attn_backend.kv_cache_shape(
            num_blocks, self.block_size, arch.num_key_value_heads, arch.head_dim
        )
        self.kv_cache = TensorKVCache(
            shape,
            arch.num_hidden_layers,
            self.block_size,
            self.config.model.dtype,
            self.platform.zeros,
        )
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB)",
            num_blocks,
            self.block_size,
            self.kv_cache.num_bytes / 2**30,
        )
        if self.platform.supports_cuda_graphs and not self.enforce_eager:
            self.graph_runner = self.platform.capture_decode_graphs(self)

    # ---- one step -------------------------------------------------------------------

    def _forward(
        self, input_ids: list[int] | torch.Tensor, positions: list[int], layout: BatchLayout
    ) -> torch.Tensor:
        """Hidden states of one flattened step: replayed from a captured graph when one
        fits the batch, else run eagerly. ``input_ids`` may already be on the device."""
        if self.graph_runner is not None and self.graph_runner.can_run(layout):
            return self.graph_runner.run(input_ids, positions, layout)
        assert self.kv_cache is not None, "initialize_kv_cache must run first"
        ctx = ForwardContext(
            attn_backend=self.attn_backend,
            attn_metadata=self.attn_backend.build_metadata(layout),
            kv_cache=self.kv_cache,
        )
        if not isinstance(input_ids, torch.Tensor):
            input_ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        positions_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        return self.model(input_ids, positions_t, ctx)

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        for data in scheduler_output.scheduled_new_reqs:
            state = self.requests.get(data.req_id)
            if state is None:
                self.requests[data.req_id] = CachedRequestState.from_new(data, self.device)
            else:
                state.resume(data)
        for data in scheduler_output.scheduled_cached_reqs:
            state = self.requests[data.req_id]
            state.block_ids.extend(data.new_block_ids)
            state.num_computed_tokens = data.num_computed_tokens

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.launch(scheduler_output).result()

    @torch.inference_mode()
    def launch(self, scheduler_output: SchedulerOutput) -> StepResult:
        """Start the step. A multi-step window returns as soon as its steps are queued on
        the device (its ``result()`` waits); any other step has finished on return."""
        self._update_states(scheduler_output)
        req_ids = [r.req_id for r in scheduler_output.scheduled_new_reqs] + [
            r.req_id for r in scheduler_output.scheduled_cached_reqs
        ]
        if not req_ids:
            return FinishedStep(ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
        states = [self.requests[r] for r in req_ids]
        if scheduler_output.num_steps > 1:
            return self._launch_decode_steps(
                req_ids, states, scheduler_output.num_steps, scheduler_output.inputs_from_previous
            )
        return FinishedStep(self._execute_step(scheduler_output, req_ids, states))

    def _execute_step(
        self,
        scheduler_output: SchedulerOutput,
        req_ids: list[str],
        states: list[CachedRequestState],
    ) -> ModelRunnerOutput:
        num_scheduled = [scheduler_output.num_scheduled_tokens[r] for r in req_ids]

        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sampled_states: list[CachedRequestState] = []
        prompt_logprob_rows: list[PromptLogprobsRows] = []
        bs = self.block_size
        for state, n in zip(states, num_scheduled):
            start = state.num_computed_tokens
            end = start + n
            input_ids.extend(state.token_ids[start:end])
            positions.extend(range(start, end))
            blocks = state.block_ids
            slot_mapping.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            row0 = query_start_loc[-1]
            query_start_loc.append(row0 + n)
            seq_lens.append(end)
            if end >= len(state.token_ids):
                sample_rows.append(row0 + n - 1)
                sampled_states.append(state)
            k = state.sampling_params.prompt_logprobs
            last_prompt_row = min(end, state.num_prompt_tokens - 1)
            if k is not None and start < last_prompt_row:
                prompt_logprob_rows.append(
                    PromptLogprobsRows(
                        state.req_id,
                        k,
                        range(row0, row0 + last_prompt_row - start),
                        state.token_ids[start + 1 : last_prompt_row + 1],
                    )
                )

        layout = BatchLayout(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=[s.block_ids for s in states],
            slot_mapping=slot_mapping,
            block_size=bs,
        )
        device = self.device
        hidden = self._forward(input_ids, positions, layout)

        logit_rows = list(sample_rows)
        for p in prompt_logprob_rows:
            logit_rows.extend(p.rows)
        logits = self.model.compute_logits(
            hidden[torch.tensor(logit_rows, dtype=torch.long, device=device)]
        )
        sampled_logits = logits[: len(sample_rows)]

        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, LogprobsLists] = {}
        if sampled_states:
            metadata = SamplingMetadata.build(
                [s.sampling_row() for s in sampled_states],
                vocab_size=sampled_logits.shape[-1],
                device=device,
                default_generator=self.default_generator,
            )
            token_bitmask = _batch_bitmask(scheduler_output.grammar_bitmask, sampled_states)
            if token_bitmask is not None:
                token_bitmask = token_bitmask.to(device, non_blocking=True)
            out = self.sampler(sampled_logits, metadata, token_bitmask)
            token_ids = out.sampled_token_ids.tolist()
            if out.logprobs is not None:
                per_row = out.logprobs.to_lists(
                    [s.sampling_params.logprobs or 0 for s in sampled_states]
                )
                for s, lists in zip(sampled_states, per_row):
                    if s.sampling_params.logprobs is not None:
                        logprobs[s.req_id] = lists
            for s, token_id in zip(sampled_states, token_ids):
                s.token_ids.append(token_id)
                sampled[s.req_id] = [token_id]

        prompt_logprobs = compute_prompt_logprobs(logits[len(sample_rows) :], prompt_logprob_rows)
        for state, n in zip(states, num_scheduled):
            state.num_computed_tokens += n
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=[sampled.get(r, []) for r in req_ids],
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def _launch_decode_steps(
        self,
        req_ids: list[str],
        states: list[CachedRequestState],
        num_steps: int,
        inputs_from_previous: bool,
    ) -> DecodeWindow:
        """Queue ``num_steps`` decode steps back to back, each feeding the tokens the
        previous one sampled (still on the device); the returned window's ``result()`` is
        the one wait for the device.

        The scheduler guarantees: every request feeds one token per step, holds slots for
        all ``num_steps`` positions, and needs nothing sampled on the host in between (no
        penalties, logprobs, grammar or pending ``min_tokens``), so one SamplingMetadata
        serves every step. Each step computes exactly what a single step would. With
        ``inputs_from_previous`` the first step feeds what the previous window sampled
        last: that window's tokens are not in the request states yet (its ``result()``
        comes first), and ``num_computed_tokens`` already counts them.
        """
        assert self.kv_cache is not None, "initialize_kv_cache must run first"
        device = self.device
        bs = self.block_size
        first_positions = [s.num_computed_tokens for s in states]
        block_tables = [s.block_ids for s in states]
        rows = [s.sampling_row() for s in states]
        metadata: SamplingMetadata | None = None
        input_ids: list[int] | torch.Tensor
        if inputs_from_previous:
            input_ids = self._previous_window_tokens(req_ids)
        else:
            input_ids = [s.token_ids[-1] for s in states]
        query_start_loc = list(range(len(states) + 1))
        sampled_steps = []
        for step in range(num_steps):
            positions = [p + step for p in first_positions]
            layout = BatchLayout(
                query_start_loc=query_start_loc,
                seq_lens=[p + 1 for p in positions],
                block_tables=block_tables,
                slot_mapping=[t[p // bs] * bs + p % bs for t, p in zip(block_tables, positions)],
                block_size=bs,
            )
            logits = self.model.compute_logits(self._forward(input_ids, positions, layout))
            if metadata is None:
                metadata = SamplingMetadata.build(
                    rows, logits.shape[-1], device, default_generator=self.default_generator
                )
            input_ids = self.sampler(logits, metadata).sampled_token_ids
            sampled_steps.append(input_ids)
        for state in states:
            state.num_computed_tokens += num_steps
        self._last_window = (req_ids, sampled_steps[-1])
        # Queue the copy to the host now, right behind this window's last step: its
        # result() must not wait for a window queued after it.
        return DecodeWindow(req_ids, states, *copy_to_host(torch.stack(sampled_steps)))

    def _previous_window_tokens(self, req_ids: list[str]) -> torch.Tensor:
        """The last tokens the previous window sampled, in ``req_ids``' order (a subset
        of that window's requests)."""
        if self._last_window is None:
            raise RuntimeError("a chained window needs a multi-step window launched before it")
        previous_ids, tokens = self._last_window
        if previous_ids == req_ids:
            return tokens
        row_of = {req_id: row for row, req_id in enumerate(previous_ids)}
        return tokens[to_device([row_of[r] for r in req_ids], torch.long, tokens.device)]


def _batch_bitmask(
    grammar_bitmask: GrammarBitmask | None, sampled_states: list[CachedRequestState]
) -> torch.Tensor | None:
    """The scheduler's bitmask rows in sampling order; ``-1`` (allow all) elsewhere.

    Returns ``[len(sampled_states), W]`` int32 on the host, or None if no row is constrained.
    """
    if grammar_bitmask is None:
        return None
    source = torch.from_numpy(grammar_bitmask.bitmask)
    if grammar_bitmask.req_ids == [state.req_id for state in sampled_states]:
        return source  # every sampled row is constrained, already in order
    row_of = {req_id: row for row, req_id in enumerate(grammar_bitmask.req_ids)}
    src_rows, dst_rows = [], []
    for dst, state in enumerate(sampled_states):
        src = row_of.get(state.req_id)
        if src is not None:
            src_rows.append(src)
            dst_rows.append(dst)
    if not src_rows:
        return None
    batch = torch.full((len(sampled_states), source.shape[1]), -1, dtype=torch.int32)
    batch[dst_rows] = source[src_rows]
    return batch
