"""Checks of an attention backend against the contract of ``pagedlm.attention.backend``.

Each check takes an ``AttentionTarget``, runs its cases for every block size and head
shape of the target, and raises ``ConformanceFailure`` naming the broken promise. Cases
are built from the block size ``B`` so that sequences end on, before and after block
boundaries, chunks start mid-block, and prefixes are shared by whole blocks.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from pagedlm.attention import BatchLayout
from pagedlm.kv_cache.interface import TensorKVCache
from pagedlm.model_executor.forward_context import ForwardContext
from pagedlm.model_executor.layers.attention import Attention
from pagedlm.testing.paged_steps import PagedSteps
from pagedlm.testing.promises import ConformanceFailure, NotApplicable
from pagedlm.testing.target import AttentionTarget

SOFT_CAP = 2.0
SOFT_CAP_QUERY_SCALE = 3.0
"""Queries scaled so that scores (std ~3 with scale head_dim**-0.5) pass the cap of 2."""
FEATURES = {
    "sliding_window": "supports_sliding_window",
    "logits_soft_cap": "supports_logits_soft_cap",
}


def _steppers(target: AttentionTarget, **kwargs) -> Iterator[PagedSteps]:
    for block_size in target.block_sizes:
        for seed, shape in enumerate(target.head_shapes):
            yield PagedSteps(target, shape, block_size, seed=seed, **kwargs)


def check_kv_cache_shape(target: AttentionTarget) -> None:
    """The first dimension is the block id, and a block holds exactly its slots' K (or V):
    ``kv_bytes_per_block`` sizes the cache from that count."""
    num_blocks = 7
    for block_size in target.block_sizes:
        for _, num_kv_heads, head_dim in target.head_shapes:
            shape = tuple(
                target.backend_cls.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
            )
            expected = num_blocks * block_size * num_kv_heads * head_dim
            if not shape or shape[0] != num_blocks or math.prod(shape) != expected:
                raise ConformanceFailure(
                    target.name,
                    "kv_cache_shape",
                    f"kv_cache_shape({num_blocks}, {block_size}, {num_kv_heads}, {head_dim}) "
                    f"is {shape}: {math.prod(shape)} elements, expected {num_blocks} first and "
                    f"{expected} in all",
                )


def check_kv_block_view(target: AttentionTarget) -> None:
    """``kv_block_view`` shows the cache as ``[num_blocks, block_size, num_kv_heads,
    head_dim]`` over the cache's own memory: the K/V ``forward`` writes at slot ``s`` are at
    ``[s // block_size, s % block_size]`` of the views, and a write through a view is a
    write into the cache (KV connectors load blocks that way)."""
    num_blocks = 3
    for block_size in target.block_sizes:
        for num_heads, num_kv_heads, head_dim in target.head_shapes:
            shape = tuple(
                target.backend_cls.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
            )
            caches = (target.allocate(shape), target.allocate(shape))
            num_tokens = block_size + 3
            generator = torch.Generator().manual_seed(block_size + head_dim)
            # One request over blocks 2, 0: the second block starts at slot 0.
            slots = [
                2 * block_size + p if p < block_size else p - block_size for p in range(num_tokens)
            ]
            layout = BatchLayout.from_lists(
                [0, num_tokens], [num_tokens], [[2, 0]], slots, block_size, target.device
            )
            new = [
                torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(
                    target.device, target.dtype
                )
                for _ in range(2)
            ]
            query = torch.zeros(num_tokens, num_heads, head_dim, device=target.device).to(
                target.dtype
            )
            backend = target.new_backend()
            metadata = backend.build_metadata(layout)
            backend.forward(query, new[0], new[1], caches[0], caches[1], metadata, 1.0)
            index = torch.tensor(slots)
            for which, cache, written in zip(("key", "value"), caches, new, strict=True):
                try:
                    view = target.backend_cls.kv_block_view(
                        cache, block_size, num_kv_heads, head_dim
                    )
                except ValueError as refusal:  # no view of its layout: KV transfer refused
                    raise NotApplicable(str(refusal)) from None
                if tuple(view.shape) != (num_blocks, block_size, num_kv_heads, head_dim):
                    raise ConformanceFailure(
                        target.name,
                        "kv_block_view",
                        f"the {which} view has shape {tuple(view.shape)}, expected "
                        f"{(num_blocks, block_size, num_kv_heads, head_dim)}",
                    )
                read = view[index // block_size, index % block_size]
                if not torch.equal(read.cpu(), written.cpu()):
                    raise ConformanceFailure(
                        target.name,
                        "kv_block_view",
                        f"the {which}s forward() wrote at slots {slots} are not at "
                        "[slot // block_size, slot % block_size] of the view",
                    )
                view[1] = written[:block_size]
                if not torch.equal(view[1].cpu(), written[:block_size].cpu()) or torch.equal(
                    cache, torch.zeros_like(cache)
                ):
                    raise ConformanceFailure(
                        target.name, "kv_block_view", f"the {which} view is not the cache's memory"
                    )
                view[1] = 0
                if cache.count_nonzero() != written.count_nonzero():
                    raise ConformanceFailure(
                        target.name,
                        "kv_block_view",
                        f"zeroing block 1 through the {which} view left other values than "
                        "the written tokens' in the cache",
                    )


def check_slot_mapping(target: AttentionTarget) -> None:
    """K/V written by one step are read back by the next through the block tables.

    The reading step recomputes the last tokens of each request (rewriting the same K/V):
    first with zero queries, so the result is the plain mean of the values read, then
    with the real queries, which weigh the keys read."""
    for steps in _steppers(target):
        size = steps.block_size
        lengths = (size + 5, 2 * size, 3)
        requests = [steps.add(n) for n in lengths]
        steps.step(list(zip(requests, lengths)), "slot_mapping", verify=False)
        for zero_queries in (True, False):
            recompute = [(requests[0], 3), (requests[1], 1), (requests[2], 1)]
            for index, num_tokens in recompute:
                steps.skip(index, -num_tokens)
            steps.step(recompute, "slot_mapping", zero_queries=zero_queries)


def check_causal_prefill(target: AttentionTarget) -> None:
    """Prompts without cached context, of lengths around the block size, in one step."""
    for steps in _steppers(target):
        size = steps.block_size
        lengths = (1, size - 1, size, size + 1, 2 * size + 5)
        steps.step([(steps.add(n), n) for n in lengths], "causal_prefill")


def _decode_case(steps: PagedSteps, promise: str, **features) -> float:
    """Ragged contexts (one ending a block short, one a one-token prompt, one exactly on
    block boundaries), prefilled, then three decode steps of every request."""
    size = steps.block_size
    contexts = (size - 1, 0, 2 * size + 3, 3 * size, 5)
    requests = [steps.add(n + 3) for n in contexts]
    prefill = [(r, n) for r, n in zip(requests, contexts) if n]
    effect = steps.step(prefill, promise if features else "causal_prefill", **features)
    for _ in range(3):
        effect = max(effect, steps.step([(r, 1) for r in requests], promise, **features))
    return effect


def _chunked_case(steps: PagedSteps, promise: str, **features) -> float:
    """A prompt of ``3B + 7`` tokens in three chunks (the second and third start mid-block)
    beside a decoding request in mixed batches; then a request that shares its first two
    blocks (a prefix-cache hit) computes the rest of its own prompt in one chunk."""
    size = steps.block_size
    prompt = steps.add(3 * size + 7)
    other = steps.add(size + 2 + 4)
    plans = [
        [(other, size + 2), (prompt, size + 3)],
        [(other, 1), (prompt, size)],
        [(prompt, size + 4), (other, 1)],
    ]
    effect = 0.0
    for plan in plans:
        effect = max(effect, steps.step(plan, promise, **features))
    sharer = steps.add(2 * size + 9, shares_blocks_of=prompt, shared_blocks=2)
    steps.skip(sharer, 2 * size)
    return max(effect, steps.step([(other, 1), (sharer, 9)], promise, **features))


def check_decode(target: AttentionTarget) -> None:
    for steps in _steppers(target):
        _decode_case(steps, "decode")


def check_chunked_prefill(target: AttentionTarget) -> None:
    for steps in _steppers(target):
        _chunked_case(steps, "chunked_prefill")


def check_write_before_read(target: AttentionTarget) -> None:
    """Two requests share the first two blocks of a prompt computed in the same step, one
    placed after the prompt in the batch and one before it."""
    for steps in _steppers(target):
        size = steps.block_size
        plan = []
        for sharer_first in (False, True):
            prompt = steps.add(2 * size + 3)
            sharer = steps.add(2 * size + 6, shares_blocks_of=prompt, shared_blocks=2)
            steps.skip(sharer, 2 * size)
            pair = [(prompt, 2 * size + 3), (sharer, 6)]
            plan += pair[::-1] if sharer_first else pair
        steps.step(plan, "write_before_read")


def check_sliding_window(target: AttentionTarget) -> None:
    """Honoured (windows shorter than a block and spanning blocks, in decode and chunked
    steps) when ``supports_sliding_window``, else refused by the attention layer."""
    if not _supports(target, "sliding_window"):
        _check_refused(target, "sliding_window", 8)
        return
    for window in (5, None):
        # None: one more than the block size, so the window spans a block boundary.
        _run_cases(target, "sliding_window", sliding_window=window)


def check_logits_soft_cap(target: AttentionTarget) -> None:
    """Honoured (with a window too, when both are supported) when
    ``supports_logits_soft_cap``, else refused by the attention layer."""
    if not _supports(target, "logits_soft_cap"):
        _check_refused(target, "logits_soft_cap", SOFT_CAP)
        return
    variants: list[dict] = [{"logits_soft_cap": SOFT_CAP}]
    if _supports(target, "sliding_window"):
        variants.append({"logits_soft_cap": SOFT_CAP, "sliding_window": 7})
    for features in variants:
        _run_cases(target, "logits_soft_cap", SOFT_CAP_QUERY_SCALE, **features)


def latent_value_dim(head_dim: int) -> int:
    """The value width the kit's latent cases use for keys of ``head_dim``: DeepSeek's 512
    of 576, else three quarters."""
    return head_dim * 8 // 9 if head_dim % 9 == 0 else head_dim * 3 // 4


def check_latent_kv(target: AttentionTarget) -> None:
    """Latent attention (one kv head that is also the value, one cache tensor) in the
    decode, chunked and shared-prefix cases when ``supports_latent_kv``, else refused by
    the attention layer."""
    flag = getattr(target.backend_cls, "supports_latent_kv", None)
    if not isinstance(flag, bool):
        raise ConformanceFailure(
            target.name, "latent_kv", f"supports_latent_kv must be a bool, got {flag!r}"
        )
    if not flag:
        _check_latent_refused(target)
        return
    for block_size in target.block_sizes:
        for seed, shape in enumerate(target.head_shapes):
            value_dim = latent_value_dim(shape.head_dim)
            for case in (_decode_case, _chunked_case):
                steps = PagedSteps(target, shape, block_size, seed=seed, value_dim=value_dim)
                case(steps, "latent_kv")


def _check_latent_refused(target: AttentionTarget) -> None:
    num_heads, _, head_dim = target.head_shapes[0]
    block_size = target.block_sizes[0]
    backend = target.new_backend()
    shape = tuple(target.backend_cls.kv_cache_shape(2, block_size, 1, head_dim))
    cache = TensorKVCache(
        shape, 1, block_size, target.dtype, lambda s, d: target.allocate(s), shares_values=True
    )
    layout = BatchLayout.from_lists([0, 1], [1], [[0]], [0], block_size, target.device)
    value_dim = latent_value_dim(head_dim)
    layer = Attention(0, num_heads, 1, head_dim, 1.0, value_dim=value_dim)
    q = torch.zeros(1, num_heads * head_dim, dtype=target.dtype, device=target.device)
    kv = torch.zeros(1, head_dim, dtype=target.dtype, device=target.device)
    try:
        layer(q, kv, kv, ForwardContext(backend, backend.build_metadata(layout), cache))
    except ValueError as exc:
        if "value_dim" in str(exc):
            return
        raise ConformanceFailure(
            target.name, "latent_kv", f"refused with a message that does not name it: {exc}"
        ) from exc
    raise ConformanceFailure(
        target.name, "latent_kv", "supports_latent_kv is False, yet a latent layer ran on it"
    )


def _run_cases(target: AttentionTarget, promise: str, query_scale: float = 1.0, **features) -> None:
    """The decode and chunked cases with ``features`` (a window of None: block_size + 1)."""
    for case in (_decode_case, _chunked_case):
        for steps in _steppers(target, query_scale=query_scale):
            used = dict(features)
            if "sliding_window" in used and used["sliding_window"] is None:
                used["sliding_window"] = steps.block_size + 1
            effect = case(steps, promise, **used)
            # The kit's own sanity: a case where the feature changes nothing proves nothing.
            if effect < 10 * target.max_relative_error:
                raise RuntimeError(f"the kit's {promise} cases do not exercise {used}")


def _supports(target: AttentionTarget, feature: str) -> bool:
    flag = getattr(target.backend_cls, FEATURES[feature], None)
    if not isinstance(flag, bool):
        raise ConformanceFailure(
            target.name,
            feature,
            f"{FEATURES[feature]} must be a bool class attribute, got {flag!r}",
        )
    return flag


def _check_refused(target: AttentionTarget, feature: str, value: float) -> None:
    """A backend without the feature is refused by the layer, with an error naming it."""
    num_heads, num_kv_heads, head_dim = target.head_shapes[0]
    block_size = target.block_sizes[0]
    backend = target.new_backend()
    shape = tuple(target.backend_cls.kv_cache_shape(2, block_size, num_kv_heads, head_dim))
    cache = TensorKVCache(shape, 1, block_size, target.dtype, lambda s, d: target.allocate(s))
    layout = BatchLayout.from_lists([0, 1], [1], [[0]], [0], block_size, target.device)
    layer = Attention(0, num_heads, num_kv_heads, head_dim, 1.0, **{feature: value})
    q = torch.zeros(1, num_heads * head_dim, dtype=target.dtype, device=target.device)
    kv = torch.zeros(1, num_kv_heads * head_dim, dtype=target.dtype, device=target.device)
    try:
        layer(q, kv, kv, ForwardContext(backend, backend.build_metadata(layout), cache))
    except ValueError as exc:
        if feature in str(exc):
            return
        raise ConformanceFailure(
            target.name, feature, f"refused with a message that does not name it: {exc}"
        ) from exc
    raise ConformanceFailure(
        target.name,
        feature,
        f"{FEATURES[feature]} is False, yet a layer with {feature}={value} ran on it",
    )
