"""The kit's checks by name, and the platform and backends it runs them on.

The platform is the one pagedlm would select (``PAGEDLM_PLATFORM``, else the best
available); every attention backend registered for it is checked. Two environment
variables narrow the attention cases to what a backend supports:
``PAGEDLM_KIT_BLOCK_SIZES=16,32`` and ``PAGEDLM_KIT_HEAD_SHAPES=4/4x32,8/2x64,4/1x128``
(query heads / KV heads x head dim).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

from pagedlm.platforms import Platform
from pagedlm.plugins import registry
from pagedlm.plugins.specs import import_target
from pagedlm.testing import attention_checks, graph_checks, platform_checks
from pagedlm.testing.target import AttentionTarget, HeadShape

BLOCK_SIZES_ENV = "PAGEDLM_KIT_BLOCK_SIZES"
HEAD_SHAPES_ENV = "PAGEDLM_KIT_HEAD_SHAPES"

BACKEND_CHECKS: dict[str, Callable[[AttentionTarget], None]] = {
    "kv_cache_shape": attention_checks.check_kv_cache_shape,
    "kv_block_view": attention_checks.check_kv_block_view,
    "slot_mapping": attention_checks.check_slot_mapping,
    "causal_prefill": attention_checks.check_causal_prefill,
    "decode": attention_checks.check_decode,
    "chunked_prefill": attention_checks.check_chunked_prefill,
    "write_before_read": attention_checks.check_write_before_read,
    "sliding_window": attention_checks.check_sliding_window,
    "logits_soft_cap": attention_checks.check_logits_soft_cap,
    "latent_kv": attention_checks.check_latent_kv,
    "graph_replay": graph_checks.check_graph_replay,
}
"""Each takes an ``AttentionTarget`` and raises ``ConformanceFailure`` or ``NotApplicable``."""

PLATFORM_CHECKS: dict[str, Callable[[Platform], None]] = {
    "identity": platform_checks.check_platform_identity,
    "dtypes": platform_checks.check_dtypes,
    "zeros": platform_checks.check_zeros,
    "memory_sizing": platform_checks.check_memory_sizing,
    "host_mapping": platform_checks.check_host_mapping,
    "fused_sampler": platform_checks.check_platform_sampler,
    "argmax_rows": platform_checks.check_platform_argmax,
    "fused_greedy_verifier": platform_checks.check_platform_greedy_verifier,
    "in_flight_corrector": platform_checks.check_platform_in_flight_corrector,
    "step_gatherer": platform_checks.check_platform_step_gatherer,
}
"""Each takes a ``Platform``; end-to-end parity is ``parity.check_greedy_parity``."""

_HEAD_SHAPE = re.compile(r"(\d+)/(\d+)x(\d+)")


def platform_under_test(name: str | None = None) -> Platform:
    """``name``, else ``PAGEDLM_PLATFORM``, else the platform pagedlm selects by default."""
    return registry.select_platform(name)


def target_settings() -> dict[str, tuple]:
    """``AttentionTarget`` fields set by the kit's environment variables."""
    settings: dict[str, tuple] = {}
    if os.environ.get(BLOCK_SIZES_ENV):
        try:
            settings["block_sizes"] = tuple(
                int(size) for size in os.environ[BLOCK_SIZES_ENV].split(",")
            )
        except ValueError:
            raise ValueError(
                f"{BLOCK_SIZES_ENV} must be comma-separated integers, e.g. 16,32; got "
                f"{os.environ[BLOCK_SIZES_ENV]!r}."
            ) from None
    if os.environ.get(HEAD_SHAPES_ENV):
        shapes = []
        for item in os.environ[HEAD_SHAPES_ENV].split(","):
            match = _HEAD_SHAPE.fullmatch(item.strip())
            if match is None:
                raise ValueError(
                    f"{HEAD_SHAPES_ENV} items look like 8/2x64 (query heads / KV heads x head "
                    f"dim); got {item!r}."
                )
            shapes.append(HeadShape(*(int(g) for g in match.groups())))
        settings["head_shapes"] = tuple(shapes)
    return settings


def backend_targets(platform: Platform) -> dict[str, AttentionTarget]:
    """Every attention backend registered for ``platform``, as a target on its device."""
    settings = target_settings()
    return {
        spec.name: AttentionTarget.for_platform(platform, import_target(spec.target), **settings)
        for spec in registry.attention_backends_for(platform)
    }
