"""``kv_transfer_config`` checked against the rest of the engine's configuration, once, at
start-up: what a KV connector cannot serve is refused with the fix named."""

from __future__ import annotations

import math
from typing import Any

from pagedlm.config import EngineConfig, KVTransferConfig

OFFLOADING_BACKENDS = ("native", "lmcache")
"""vLLM's ``kv_offloading_backend`` names; pagedlm serves "native" only."""


def offloading_transfer_config(
    size_gib: float | None, backend: str, kv_transfer_config: dict[str, Any] | str | None
) -> dict[str, Any] | str | None:
    """The ``kv_transfer_config`` that ``kv_offloading_size`` / ``kv_offloading_backend``
    (vLLM's flags) build: the OffloadingConnector over ``size_gib`` GiB of host memory, or
    ``kv_transfer_config`` as given when the size is None. ValueError, naming the fix, for
    a size that is not a positive number, a backend other than "native", or both a size
    and a ``kv_transfer_config`` (vLLM replaces the latter's connector; pagedlm refuses)."""
    if backend not in OFFLOADING_BACKENDS:
        raise ValueError(
            f"Unknown kv_offloading_backend {backend!r}; known: {list(OFFLOADING_BACKENDS)} "
            "(pagedlm serves 'native')."
        )
    if size_gib is None:
        return kv_transfer_config
    if (
        isinstance(size_gib, bool)
        or not isinstance(size_gib, (int, float))
        or not math.isfinite(size_gib)
        or size_gib <= 0
    ):
        raise ValueError(
            f"kv_offloading_size must be a positive number of GiB, got {size_gib!r}; e.g. "
            "--kv-offloading-size 4, or leave it unset (no offloading)."
        )
    if backend == "lmcache":
        raise ValueError(
            "kv_offloading_backend='lmcache' needs vLLM's LMCache connector, which pagedlm "
            "does not have; use kv_offloading_backend='native' (pagedlm's host-memory pool) "
            "or drop kv_offloading_size."
        )
    if KVTransferConfig.parse(kv_transfer_config) is not None:
        raise ValueError(
            "kv_offloading_size builds its own kv_transfer_config (the OffloadingConnector), "
            "so it cannot be combined with one; drop kv_transfer_config, or drop "
            "kv_offloading_size and give the OffloadingConnector in kv_transfer_config "
            '(kv_connector_extra_config {"cpu_bytes_to_use": <bytes>}).'
        )
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": int(size_gib * 2**30)},
    }


def check_kv_transfer_config(config: EngineConfig) -> None:
    """ValueError for a connector that cannot be found or refuses its options, and for the
    combinations no connector here supports."""
    transfer = config.kv_transfer
    if transfer is None:
        return
    from pagedlm.kv_transfer.factory import connector_class

    cls = connector_class(transfer)
    parallel = config.parallel
    if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
        raise ValueError(
            "kv_transfer_config needs tensor_parallel_size=1 and pipeline_parallel_size=1 (a "
            "stored block holds every layer's and head's KV, and each rank holds only part); "
            "drop kv_transfer_config or run on one device (data parallelism is fine)."
        )
    speculative = config.speculative
    if speculative is not None and speculative.proposer_writes_kv:
        raise ValueError(
            f"kv_transfer_config does not move a {speculative.method!r} proposer's own KV, "
            "so its drafts would read blocks nobody computed; use speculative method "
            "'ngram' or drop one of them."
        )
    if config.cache.calculate_kv_scales and config.cache.cache_dtype != "auto":
        raise ValueError(
            "kv_transfer_config with calculate_kv_scales: each engine measures its own FP8 "
            "scales, so stored FP8 blocks would be read with another engine's scales; drop "
            "calculate_kv_scales (the checkpoint's scales are shared) or kv_transfer_config."
        )
    cls.check_config(config)
