"""``kv_transfer_config`` checked against the rest of the engine's configuration, once, at
start-up: what a KV connector cannot serve is refused with the fix named."""

from __future__ import annotations

from pagedlm.config import EngineConfig


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
