"""The promises the conformance kit checks, each pointing at the docstring that states it.

The invariants themselves are stated once, in the interfaces' docstrings; a promise here is
a one-line name for a failure message and the place to read the full statement.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Promise:
    id: str
    summary: str
    stated_in: str
    """Where the invariant is stated (``module:Object.member``)."""


_BACKEND = "pagedlm.attention.backend"
_PLATFORM = "pagedlm.platforms.interface"

PROMISES: dict[str, Promise] = {
    p.id: p
    for p in (
        Promise(
            "kv_cache_shape",
            "kv_cache_shape() starts with num_blocks and holds exactly block_size * "
            "num_kv_heads * head_dim elements per block",
            f"{_BACKEND}:AttentionBackend.kv_cache_shape",
        ),
        Promise(
            "kv_block_view",
            "kv_block_view() shows a layer's cache as [num_blocks, block_size, num_kv_heads, "
            "head_dim] over the cache's memory, slot s at [s // block_size, s % block_size]",
            f"{_BACKEND}:AttentionBackend.kv_block_view",
        ),
        Promise(
            "output",
            "forward() returns [num_tokens, num_heads, head_dim] in the query's dtype and device",
            f"{_BACKEND}:AttentionBackend.forward",
        ),
        Promise(
            "slot_mapping",
            "the K/V of token t are written at slot_mapping[t] = block * block_size + offset "
            "and read back by later steps through block_table",
            f"{_BACKEND}:BatchLayout",
        ),
        Promise(
            "causal_prefill",
            "a request's new tokens attend causally to each other (no cached context)",
            f"{_BACKEND}:AttentionBackend",
        ),
        Promise(
            "decode",
            "a one-token query attends to all seq_len positions of its request, never past them",
            f"{_BACKEND}:BatchLayout",
        ),
        Promise(
            "chunked_prefill",
            "a chunk attends to its request's cached prefix (its context_len positions, shared "
            "blocks included) and causally to its own tokens",
            f"{_BACKEND}:BatchLayout",
        ),
        Promise(
            "write_before_read",
            "forward() writes the step's K/V before reading, so a request may read blocks "
            "that another request of the same step fills",
            f"{_BACKEND}:AttentionBackend",
        ),
        Promise(
            "sliding_window",
            "with supports_sliding_window, sliding_window=w limits the query at position p to "
            "keys p-w+1..p; without it the attention layer refuses the model",
            f"{_BACKEND}:AttentionBackend.forward",
        ),
        Promise(
            "logits_soft_cap",
            "with supports_logits_soft_cap, scores become c*tanh(s/c) before the softmax; "
            "without it the attention layer refuses the model",
            f"{_BACKEND}:AttentionBackend.forward",
        ),
        Promise(
            "latent_kv",
            "with supports_latent_kv, forward(value_dim=d) attends over one cache tensor whose "
            "keys' first d features are the values (latent attention) and returns d features "
            "per head; without it the attention layer refuses the model",
            f"{_BACKEND}:AttentionBackend.forward",
        ),
        Promise(
            "graph_metadata",
            "build_graph_metadata()'s result reads the static buffers at every replay (after "
            "prepare_graph_replay), never values copied at capture",
            f"{_BACKEND}:AttentionBackend.build_graph_metadata",
        ),
        Promise(
            "padding_rows",
            "padding rows (slot -1, seq_len 0) write no K/V and leave the real rows' results "
            "unchanged",
            f"{_BACKEND}:BatchLayout",
        ),
        Promise(
            "platform_identity",
            "the platform's name, device and default attention backend and executor resolve "
            "through the registry",
            f"{_PLATFORM}:Platform",
        ),
        Promise(
            "dtype",
            "check_dtype() accepts supported_dtypes and raises ValueError naming a supported "
            "dtype for any other",
            f"{_PLATFORM}:Platform",
        ),
        Promise(
            "zeros",
            "zeros(shape, dtype) returns a zero-filled tensor of that shape and dtype on device",
            f"{_PLATFORM}:Platform.zeros",
        ),
        Promise(
            "memory_sizing",
            "kv_cache_memory_bytes(bytes_per_block) is an int budget >= 0 the KV cache may fill "
            "entirely, or a ValueError that says how to make one sequence fit",
            f"{_PLATFORM}:Platform.kv_cache_memory_bytes",
        ),
        Promise(
            "host_mapping",
            "map_host_tensor(host) is None or a device tensor over the host tensor's memory: "
            "same shape, dtype and values, writes shown both ways",
            f"{_PLATFORM}:Platform.map_host_tensor",
        ),
        Promise(
            "fused_sampler",
            "fused_sampler() is None or draws [N] int64 ids: the argmax for greedy rows, "
            "softmax(logits / temperature) for the others, leaving the logits unchanged",
            "pagedlm.sample.sampler:FusedRandomSampler",
        ),
        Promise(
            "argmax_rows",
            "argmax_rows() gives each row's first maximal index as [N] int64, torch.max's "
            "indices (ties, NaN and -inf rows included), leaving the logits unchanged",
            f"{_PLATFORM}:Platform.argmax_rows",
        ),
        Promise(
            "fused_greedy_verifier",
            "fused_greedy_verifier() is None or gives the rejection sampler's tokens and "
            "counts for all-greedy rows and writes the token table and rejected counts as "
            "Speculator.verify does",
            "pagedlm.sample.rejection_sampler:FusedGreedyVerifier",
        ),
        Promise(
            "in_flight_corrector",
            "in_flight_corrector() is None or shifts a step's positions, indices and lengths "
            "by the in-flight rejections as correct_on_device does",
            "pagedlm.worker.spec_positions:correct_on_device",
        ),
        Promise(
            "step_gatherer",
            "step_gatherer() is None or gathers a step's input ids, slot mapping and rows' "
            "block tables as gather_on_device does",
            "pagedlm.worker.step_inputs:gather_on_device",
        ),
        Promise(
            "executor_choice",
            "the engine runs the platform's default_executor, registered for the platform",
            f"{_PLATFORM}:Platform",
        ),
        Promise(
            "greedy_parity",
            "greedy generation gives the CPU platform's tokens on the same checkpoint "
            "(prepare_model and the backend change results by rounding only)",
            f"{_PLATFORM}:Platform.prepare_model",
        ),
    )
}


class ConformanceFailure(AssertionError):
    """A platform or backend broke a promise of the plugin contract."""

    def __init__(self, subject: str, promise_id: str, detail: str) -> None:
        self.subject = subject
        self.promise = PROMISES[promise_id]
        self.detail = detail
        super().__init__(
            f"{subject} breaks promise '{promise_id}': {self.promise.summary} "
            f"(stated in {self.promise.stated_in}). {detail}"
        )


class NotApplicable(Exception):
    """A check that does not apply to this target (a feature it does not offer)."""
