"""Runs one step in two calls: the forward, then the sampling.

``execute_model(scheduler_output)`` applies the step's request changes to the persistent
input batch, builds the step's inputs on the device (``step_inputs.py``), runs the model
(replayed from a captured graph when the batch is uniform and a graph fits) and computes
the logits of the rows that sample or want prompt logprobs. ``sample_tokens(bitmask)``
then samples them, scatters the sampled ids into the batch's token table (the next step
reads them there, on the device) and returns a ``LaunchedStep`` whose ``result()`` is the
one wait for the device. Neither call waits for the device, so under asynchronous
scheduling the engine queues step N+1's forward before it reads step N's tokens, and
builds step N+1's grammar bitmask from them while that forward runs.

Structured outputs: the scheduler owns the grammar matchers and passes the bitmask of the
constrained requests that sample to ``sample_tokens`` (as in vLLM); the runner only lays
its rows out in sampling order and hands it to the sampler.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np
import torch

from pagedlm.attention import AttentionBackend, BatchLayout
from pagedlm.batch_invariant import make_batch_invariant
from pagedlm.config import EngineConfig
from pagedlm.distributed.parallel_state import get_pipeline_state
from pagedlm.kv_cache import fp8
from pagedlm.kv_cache.fp8 import kv_cache_torch_dtype
from pagedlm.kv_cache.interface import KVCache, TensorKVCache, kv_bytes_per_block
from pagedlm.kv_transfer.factory import KVConnectorRole, make_connector
from pagedlm.kv_transfer.kv_blocks import KVCacheBlocks
from pagedlm.lora.manager import make_lora
from pagedlm.model_executor.forward_context import ForwardContext
from pagedlm.model_executor.layers.attention import (
    arm_kv_scale_calculation,
    kv_scales_pending,
    model_kv_geometry,
)
from pagedlm.model_executor.loader import load_model
from pagedlm.model_executor.weight_offload import make_weight_offload
from pagedlm.multimodal.encoder_runner import make_encoder_runner
from pagedlm.multimodal.mrope import make_positions
from pagedlm.platforms import Platform
from pagedlm.platforms.interface import GraphRunner
from pagedlm.pooling.pooler import PooledStep, make_pooler
from pagedlm.sample.host_copy import tensor_to_device
from pagedlm.sample.logprobs import compute_logprobs
from pagedlm.sample.metadata import SamplingMetadata
from pagedlm.sample.sampler import Sampler
from pagedlm.spec_decode.model_drafter import TargetParts
from pagedlm.step import (
    FinishedStep,
    GrammarBitmask,
    KVConnectorOutput,
    ModelRunnerOutput,
    SchedulerOutput,
    StepResult,
)
from pagedlm.worker.input_batch import InputBatch
from pagedlm.worker.latent_kv import choose_latent_kv
from pagedlm.worker.launched_step import LaunchedStep, Verified
from pagedlm.worker.logits_processors import make_logits_processors
from pagedlm.worker.pipeline_stage import run_stage, write_new_token_ids
from pagedlm.worker.prompt_embeds import make_prompt_embeds
from pagedlm.worker.sampling_inputs import (
    DeviceTokenHistory,
    SamplingMetadataCache,
    sampling_rows,
    verification_rows,
)
from pagedlm.worker.speculative import Speculator
from pagedlm.worker.step_inputs import StepInputBuilder, StepInputs

logger = logging.getLogger(__name__)

ENFORCE_EAGER_ENV = "PAGEDLM_ENFORCE_EAGER"
"""Set to 1 to never replay steps from CUDA graphs (also ``enforce_eager``)."""


@dataclass(frozen=True)
class _ForwardDone:
    """A step between ``execute_model`` and ``sample_tokens``."""

    inputs: StepInputs
    logits: torch.Tensor | None
    """[num_sampling_rows + num_prompt_logprob_rows, vocab]; None on a pipeline stage
    before the last (the last one samples)."""
    hidden: torch.Tensor | None
    """[num_tokens, hidden] the step's hidden states (proposers read them)."""
    to_propose: dict[str, int]
    """``SchedulerOutput.num_drafts_to_propose``."""
    pooled: PooledStep | None = None
    """The pooling runner's outputs of the step (then no logits)."""


def model_attention_layers(model: torch.nn.Module) -> list[int]:
    """Global indices of the attention layers this worker holds (its pipeline stage's)."""
    from pagedlm.model_executor.layers.attention import Attention

    return sorted(m.layer_idx for m in model.modules() if isinstance(m, Attention))


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        platform: Platform,
        attn_backend_cls: type[AttentionBackend],
        weights: Iterable[tuple[str, torch.Tensor]] | None = None,
    ) -> None:
        """``weights``: load these ``(name, tensor)`` pairs instead of the checkpoint's
        (``Worker.reload_weights``)."""
        self.config = config
        self.platform = platform
        self.device = platform.device
        self.block_size = config.cache.block_size
        self.arch = config.model.arch
        weights = None if weights is None else list(weights)  # the target's, and an MTP layer's
        self.weight_offload = make_weight_offload(
            config.cache.cpu_offload_gb,
            platform.name,
            platform.map_host_tensor,
            platform.empty_host,
        )
        """Weights in host memory that the device reads in place (None: none)."""
        self.model = load_model(
            config.model,
            self.device,
            keep_weight_blocks=platform.computes_on_weight_blocks(config.model),
            gguf_groups_of_16=platform.gguf_groups_of_16,
            weights=weights,
            offload=self.weight_offload,
        )
        if self.weight_offload is not None:  # before kernels keep references to tensors
            self.weight_offload.settle([self.model])
            platform.release_memory()  # the device copies of what settle moved
        platform.prepare_model(self.model)
        choose_latent_kv(self.model, config, attn_backend_cls)
        if config.batch_invariant:
            make_batch_invariant(self.model)
        if self.weight_offload is not None:
            self.weight_offload.prune([self.model])  # e.g. a folded kv_b_proj's host copy
        self.lora = make_lora(config, platform, self.model)
        self.encoder = make_encoder_runner(self.model, self.device, attn_backend_cls)
        self.prompt_embeds = make_prompt_embeds(config, self.model, self.device)
        self.rope_positions = make_positions(self.model, self.device)
        self.kv_geometry = model_kv_geometry(
            self.model, self.arch.num_key_value_heads, self.arch.head_dim
        )
        layers = model_attention_layers(self.model) or [0]
        self.first_layer, self.num_layers = layers[0], len(layers)
        self.attn_backend = attn_backend_cls(self.device)
        self.attn_backend.set_batch_invariant(config.batch_invariant)
        self.kv_cache_dtype = kv_cache_torch_dtype(config.cache.cache_dtype, config.model.dtype)
        if fp8.is_fp8(self.kv_cache_dtype) and not self.attn_backend.supports_fp8_kv_cache:
            raise ValueError(
                f"kv_cache_dtype={config.cache.cache_dtype!r} needs an attention backend "
                f"that reads an FP8 cache; {self.attn_backend.name!r} does not. Use "
                "kv_cache_dtype='auto' or another attention_backend."
            )
        self.sampler = Sampler(
            platform.fused_sampler(), config.model.logprobs_mode, platform.argmax_rows()
        )
        self.logits_processors = make_logits_processors(
            config, self.device, platform.pin_host_memory
        )
        self.default_generator = torch.Generator(device=self.device)
        self.default_generator.manual_seed(config.model.seed)
        sched = config.scheduler
        self.input_batch = InputBatch(
            sched.max_num_seqs, sched.max_model_len, self.block_size, self.device
        )
        host_lengths = self.attn_backend.reads_host_lengths
        self.step_inputs = StepInputBuilder(
            self.input_batch,
            sched.max_num_batched_tokens,
            host_lengths,
            self.rope_positions,
            in_flight_corrector=platform.in_flight_corrector(),
            gatherer=platform.step_gatherer(),
        )
        target = TargetParts(
            self.model,
            self.attn_backend,
            platform,
            config.model.dtype,
            sched.max_num_batched_tokens,
            self.kv_cache_dtype,
            weights,
        )
        self.speculator = Speculator(
            config,
            self.input_batch,
            target,
            self.sampler,
            host_lengths,
            greedy_verifier=platform.fused_greedy_verifier(),
        )
        self.pooler = make_pooler(config.model, self.model)
        """The pooling runner's pooler (None: the runner samples tokens)."""
        self.kv_cache: KVCache | None = None
        self.kv_connector = make_connector(config, KVConnectorRole.WORKER)
        """A KV connector's worker side (None: no ``kv_transfer_config``): loads before the
        forward, saves after it (``pagedlm.kv_transfer``)."""
        self.graph_runner: GraphRunner | None = None
        self._measuring_kv_scales = False
        self._forward_done: _ForwardDone | None = None
        self._unreadable_adapters: dict[str, str] = {}
        """Requests of the queued forward whose adapter could not be read (they ran
        without it): reported with the step's sampling, for the scheduler to fail."""
        self._sampling_metadata = SamplingMetadataCache()
        self.enforce_eager = (
            bool(getattr(config.model, "enforce_eager", False))
            or config.compilation.cudagraph_mode == "NONE"
            or os.environ.get(ENFORCE_EAGER_ENV, "0") not in ("", "0")
            or not self.lora.graph_safe
        )
        if platform.profiles_memory:
            self.profile_run()

    def profile_run(self) -> None:
        """One forward at the step's largest shape (``max_num_batched_tokens`` tokens, then
        logits for ``max_num_seqs`` rows, and for one and two) over a throwaway KV cache,
        so the platform sees the activation peak before it sizes the real cache."""
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
        cache = self._allocate_kv_cache(next_block)
        layout = BatchLayout.from_lists(query_start_loc, lens, tables, slots, bs, self.device)
        ctx = ForwardContext(self.attn_backend, self.attn_backend.build_metadata(layout), cache)
        with torch.inference_mode():
            ids = torch.zeros(num_tokens, dtype=torch.int32, device=self.device)
            positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
            hidden = run_stage(self.model, ids, positions, ctx, self.config.model.dtype)
            if hidden is not None and self.pooler is None:
                rows = hidden[: min(sched.max_num_seqs, num_tokens)]
                rows = rows.repeat(-(-sched.max_num_seqs // rows.shape[0]), 1)
                self.model.compute_logits(rows[: sched.max_num_seqs]).softmax(-1)
                # A platform may route one row and a few rows to kernels of their own (the
                # logits run outside CUDA graphs): compiled here, not inside serving.
                for num_rows in (1, 2):
                    self.model.compute_logits(rows[:num_rows])
        self.platform.synchronize()

    # ---- KV cache -------------------------------------------------------------------

    def kv_bytes_per_block(self) -> int:
        """Bytes of one block on this worker: its own KV heads, its own layers."""
        geometry = self.kv_geometry
        target = kv_bytes_per_block(
            self.block_size,
            self.num_layers,
            geometry.num_kv_heads,
            geometry.head_dim,
            self.kv_cache_dtype,
            shares_values=geometry.shares_values,
        )
        return target + self.speculator.kv_bytes_per_block()  # a proposer's own KV too

    def _allocate_kv_cache(self, num_blocks: int) -> TensorKVCache:
        geometry = self.kv_geometry
        return self._allocate(
            num_blocks,
            self.num_layers,
            geometry.num_kv_heads,
            geometry.head_dim,
            self.first_layer,
            shares_values=geometry.shares_values,
        )

    def _allocate(
        self,
        num_blocks: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        first_layer: int = 0,
        shares_values: bool = False,
    ) -> TensorKVCache:
        shape = self.attn_backend.kv_cache_shape(
            num_blocks, self.block_size, num_kv_heads, head_dim
        )
        return TensorKVCache(
            shape,
            num_layers,
            self.block_size,
            self.kv_cache_dtype,
            self.platform.zeros,
            first_layer=first_layer,
            shares_values=shares_values,
        )

    def release_kv_cache(self) -> None:
        """Drop the KV caches (the target's and a proposer's) and the graphs that point
        into them (sleep mode); ``initialize_kv_cache`` makes them again. Prompt rows
        still held for requests the engine has let go (aborted since the last step) go
        too: the engine sleeps without unfinished requests."""
        self.kv_cache = None
        self.graph_runner = None
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(None)
        self.speculator.release_kv_cache()
        self.prompt_embeds.clear()

    def weight_modules(self) -> list[torch.nn.Module]:
        """Every module whose weights this runner holds: the model's, a proposer's."""
        return [self.model, *self.speculator.weight_modules()]

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_cache = self._allocate_kv_cache(num_blocks)
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(
                KVCacheBlocks(
                    self.kv_cache,
                    type(self.attn_backend),
                    range(self.first_layer, self.first_layer + self.num_layers),
                    self.kv_geometry.num_kv_heads,
                    self.kv_geometry.head_dim,
                    pin_host_memory=self.platform.pin_host_memory,
                    empty_host=self.platform.empty_host,
                )
            )
        self.speculator.initialize_kv_cache(num_blocks, self._allocate)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB)",
            num_blocks,
            self.block_size,
            self.kv_cache.num_bytes / 2**30,
        )
        # Graphs capture one forward; a pipeline stage also waits on its neighbours.
        pipelined = get_pipeline_state().world_size > 1
        # Graphs capture decode steps; a pooling runner never decodes.
        decodes = self.pooler is None
        if (
            self.platform.supports_cuda_graphs
            and not self.enforce_eager
            and not pipelined
            and decodes
        ):
            self.graph_runner = self.platform.capture_graphs(self)
            self.speculator.capture_graphs(self)
        if self.config.cache.calculate_kv_scales and fp8.is_fp8(self.kv_cache_dtype):
            # After the profiling run and the captures, so real keys set the scales.
            arm_kv_scale_calculation(self.model)
            self._measuring_kv_scales = True

    # ---- one step -------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """Queue the step's forward and logits; ``sample_tokens`` must follow. A KV
        connector's loads are written before the forward, its saves read after it."""
        transfers = scheduler_output.kv_connector_metadata
        if self.kv_connector is None or transfers is None:
            self._execute_model(scheduler_output)
            return
        self.kv_connector.start_load_kv(transfers)
        self._execute_model(scheduler_output)
        self.kv_connector.wait_for_save(transfers)

    def _execute_model(self, scheduler_output: SchedulerOutput) -> None:
        if self._forward_done is not None:
            raise RuntimeError("sample_tokens must be called after every execute_model")
        self.input_batch.update(scheduler_output)
        write_new_token_ids(self.input_batch, scheduler_output)
        self.speculator.admit(scheduler_output)
        if self.logits_processors is not None:
            self.logits_processors.admit(scheduler_output)
        self.encoder.update(scheduler_output)
        self.prompt_embeds.update(scheduler_output)
        self.rope_positions.update(scheduler_output)
        if self.pooler is not None:
            self.pooler.update(scheduler_output)
        if scheduler_output.is_empty:
            self.input_batch.flush()
            return
        feeds_images = self.encoder.feeds_images(scheduler_output)
        feeds_embeds = self.prompt_embeds.feeds(scheduler_output)
        inputs = self.step_inputs.build(
            scheduler_output,
            None if feeds_images or feeds_embeds else self._padded_num_reqs(scheduler_output),
            self.speculator.num_rejected,
        )
        layout = inputs.layout
        self._unreadable_adapters = self.lora.prepare_step(
            inputs.states, layout.query_start_loc_cpu, layout.num_tokens
        )
        if feeds_images or feeds_embeds:  # eager, from embeddings: images', prompts' rows
            spans: tuple[tuple[int, int, int], ...] = ()
            if feeds_images:
                embeds = self.encoder.step_embeddings(scheduler_output, inputs.input_ids, layout)
                spans = self.encoder.bidirectional_spans(scheduler_output)
            else:
                embeds = self.model.embed_input_ids(inputs.input_ids)
            if feeds_embeds:
                self.prompt_embeds.write(embeds, scheduler_output, layout)
            hidden = self._forward_embeddings(inputs, embeds, spans)
        else:
            hidden = self._forward(inputs)
        if hidden is None:  # a pipeline stage before the last: no logits here
            self._forward_done = _ForwardDone(inputs, None, None, {})
            return
        if self.pooler is not None:
            pooled = self.pooler.pool(
                hidden, inputs.req_ids, layout.query_start_loc_cpu, inputs.seq_lens, inputs.sampled
            )
            self._forward_done = _ForwardDone(inputs, None, None, {}, pooled)
            return
        if inputs.logits_indices is None:
            rows = hidden[: len(inputs.sampled)]
        else:
            rows = hidden.index_select(0, inputs.logits_indices)
        logits = self.model.compute_logits(rows) if rows.shape[0] else rows
        self._forward_done = _ForwardDone(
            inputs, logits, hidden, scheduler_output.num_drafts_to_propose
        )

    def _padded_num_reqs(self, scheduler_output: SchedulerOutput) -> int | None:
        """The captured graph size this step replays at, if its batch is uniform (every
        request feeds the same number of tokens) and a graph fits."""
        if self.graph_runner is None:
            return None
        num_reqs = len(scheduler_output.num_scheduled_tokens)
        query_len, remainder = divmod(scheduler_output.total_num_scheduled_tokens, num_reqs)
        if remainder or any(n != query_len for n in scheduler_output.num_scheduled_tokens.values()):
            return None
        return self.graph_runner.padded_num_reqs(num_reqs, query_len)

    def _forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """Hidden states of the step's (padded) tokens (None on a pipeline stage before
        the last)."""
        if inputs.padded_num_reqs is not None:
            assert self.graph_runner is not None
            return self.graph_runner.run(inputs.layout)
        assert self.kv_cache is not None, "initialize_kv_cache must run first"
        ctx = ForwardContext(
            self.attn_backend, self.attn_backend.build_metadata(inputs.layout), self.kv_cache
        )
        # Never under pipeline parallelism; nor while attention layers still have to see a
        # real step's keys to measure their FP8 scales (a replay runs no layer code).
        if self.graph_runner is not None and not self._measuring_kv_scales:
            hidden = self.graph_runner.run_mixed(inputs.input_ids, ctx)
            if hidden is not None:  # padded to a captured size: proposers read every row
                return hidden[: inputs.layout.num_tokens]
        hidden = run_stage(
            self.model, inputs.input_ids, inputs.positions, ctx, self.config.model.dtype
        )
        if self._measuring_kv_scales:
            self._measuring_kv_scales = kv_scales_pending(self.model)
        return hidden

    def _forward_embeddings(
        self, inputs: StepInputs, embeds: torch.Tensor, spans: tuple[tuple[int, int, int], ...]
    ) -> torch.Tensor:
        """Hidden states of a step fed from token embeddings (images, prompts given as
        embeddings; both on one pipeline stage); ``spans``: the layout's
        ``bidirectional_spans``. The positions are the rotary's for image tokens too
        ([3, T] for M-RoPE models)."""
        assert self.kv_cache is not None, "initialize_kv_cache must run first"
        layout = replace(inputs.layout, bidirectional_spans=spans) if spans else inputs.layout
        ctx = ForwardContext(
            self.attn_backend, self.attn_backend.build_metadata(layout), self.kv_cache
        )
        num_new = np.diff(layout.query_start_loc_cpu[: len(inputs.req_ids) + 1])
        positions = self.rope_positions.step_positions(
            inputs.positions, inputs.req_ids, inputs.seq_lens - num_new, num_new
        )
        return self.model(inputs.input_ids, positions, ctx, inputs_embeds=embeds)

    def sample_tokens(self, grammar_bitmask: GrammarBitmask | None) -> StepResult:
        """Sample (or verify) the step ``execute_model`` queued, then let the proposer draft
        the next step's tokens; the result is collected later (with a KV connector's report
        of the step's transfers)."""
        result = self._sample_tokens(grammar_bitmask)
        unreadable, self._unreadable_adapters = self._unreadable_adapters, {}
        if unreadable:
            result = _WithFailures(result, unreadable)
        if self.kv_connector is not None:
            report = self.kv_connector.get_connector_output()
            if report is not None:
                return _WithConnectorOutput(result, report)
        return result

    @torch.inference_mode()
    def _sample_tokens(self, grammar_bitmask: GrammarBitmask | None) -> StepResult:
        done, self._forward_done = self._forward_done, None
        if done is None:
            return FinishedStep(ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
        inputs, logits = done.inputs, done.logits
        if done.pooled is not None:
            return done.pooled
        if logits is None:  # a stage before the last: the last one samples and reports
            return FinishedStep(ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
        batch = self.input_batch
        sampled = inputs.sampled
        # Every request samples in a decode step: then ``sampled`` is 0..n-1.
        states = (
            inputs.states
            if len(sampled) == len(inputs.states)
            else [inputs.states[i] for i in sampled]
        )
        num_rows = inputs.num_sampling_rows
        num_sampling_rows = int(num_rows.sum())
        token_ids, logprobs, verified = None, None, None
        failed: dict[str, str] = {}
        if len(sampled):
            # One sampling row per logits row: a verifying request's rows follow its drafts.
            row_states, row_lens = verification_rows(
                states, inputs.seq_lens[sampled] - inputs.num_drafts[sampled], num_rows
            )
            processors = None
            if self.logits_processors is not None:
                processors = self.logits_processors.before_sampling(row_states)
            metadata = self._sampling_metadata.get(
                row_states,
                row_lens,
                lambda: SamplingMetadata.build(
                    sampling_rows(row_states, row_lens),
                    vocab_size=logits.shape[-1],
                    device=self.device,
                    default_generator=self.default_generator,
                    token_history=DeviceTokenHistory(batch, row_states, row_lens),
                    logits_processors=processors,
                ),
            )
            bitmask = None
            if grammar_bitmask is not None:
                bitmask = _batch_bitmask(grammar_bitmask, [s.req_id for s in row_states])
            if bitmask is not None:
                bitmask = tensor_to_device(bitmask, self.device)
            if num_sampling_rows > len(sampled):
                out = self.speculator.verify(logits[:num_sampling_rows], metadata, bitmask, inputs)
                token_ids, logprobs = out.token_ids, out.logprobs
                verified = Verified(out.num_emitted, num_rows.tolist())
            else:
                out = self.sampler(logits[: len(sampled)], metadata, bitmask)
                token_ids, logprobs = out.sampled_token_ids, out.logprobs
                batch.token_ids.view(-1).index_put_(
                    (inputs.sample_token_index,), token_ids.to(torch.int32)
                )
            if self.logits_processors is not None:
                failed = self.logits_processors.failures(row_states)
        proposals = self.speculator.after_step(
            inputs, done.hidden, None if verified is None else verified.num_emitted, done.to_propose
        )
        prompt_logprobs = None
        if inputs.prompt_logprob_rows:
            assert inputs.prompt_target_index is not None
            targets = batch.token_ids.view(-1)[inputs.prompt_target_index]
            num_top = max(rows.num_logprobs for rows in inputs.prompt_logprob_rows)
            prompt_logprobs = compute_logprobs(logits[num_sampling_rows:], targets, num_top)
        if token_ids is None:
            token_ids = torch.zeros(0, dtype=torch.int64, device=self.device)
        launched = LaunchedStep(
            req_ids=inputs.req_ids,
            sampled=sampled.tolist(),
            token_ids=token_ids,
            logprobs=logprobs,
            num_logprobs=(
                None if logprobs is None else [s.sampling_params.logprobs for s in states]
            ),
            prompt_logprobs=prompt_logprobs,
            prompt_parts=inputs.prompt_logprob_rows,
            verified=verified,
            proposals=proposals,
            failed=failed,
        )
        if self.logits_processors is not None and len(sampled):
            self.logits_processors.launched(launched, states, inputs.seq_lens[sampled])
        return launched

    def execute_and_sample(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: GrammarBitmask | None = None
    ) -> ModelRunnerOutput:
        """One whole step, waited for (tests and simple drivers)."""
        self.execute_model(scheduler_output)
        return self.sample_tokens(grammar_bitmask).result()


class _WithFailures:
    """A launched step whose output also fails requests the runner failed before sampling
    (their adapter could not be read)."""

    def __init__(self, step: StepResult, failed: dict[str, str]) -> None:
        self.step = step
        self.failed = failed

    def result(self) -> ModelRunnerOutput:
        output = self.step.result()
        return replace(output, failed={**self.failed, **output.failed})


class _WithConnectorOutput:
    """A launched step whose output carries the KV connector's report."""

    def __init__(self, step: StepResult, report: KVConnectorOutput) -> None:
        self.step = step
        self.report = report

    def result(self) -> ModelRunnerOutput:
        return replace(self.step.result(), kv_connector_output=self.report)


def _batch_bitmask(
    grammar_bitmask: GrammarBitmask | None, sampled_req_ids: list[str]
) -> torch.Tensor | None:
    """The scheduler's bitmask rows in sampling order; ``-1`` (allow all) elsewhere.

    Returns ``[len(sampled_req_ids), W]`` int32 on the host, or None if no row is
    constrained.
    """
    if grammar_bitmask is None:
        return None
    source = torch.from_numpy(grammar_bitmask.bitmask)
    if grammar_bitmask.req_ids == sampled_req_ids:
        return source  # every sampled row is constrained, already in order
    # A request verifying drafts has consecutive rows on both sides, one per position.
    row_of: dict[str, int] = {}
    for row, req_id in enumerate(grammar_bitmask.req_ids):
        row_of.setdefault(req_id, row)
    src_rows, dst_rows = [], []
    previous, offset = None, 0
    for dst, req_id in enumerate(sampled_req_ids):
        offset = offset + 1 if req_id == previous else 0
        previous = req_id
        src = row_of.get(req_id)
        if src is not None:
            src_rows.append(src + offset)
            dst_rows.append(dst)
    if not src_rows:
        return None
    batch = torch.full((len(sampled_req_ids), source.shape[1]), -1, dtype=torch.int32)
    batch[dst_rows] = source[src_rows]
    return batch
