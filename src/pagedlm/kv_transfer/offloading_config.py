"""The offloading connector's options (``offloading.py``), checked once at start-up, and
the host pool's size in blocks from them."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pagedlm.kv_cache.interface import kv_bytes_per_block
from pagedlm.kv_transfer.bookkeeping import check_extra_config_keys

if TYPE_CHECKING:
    from pagedlm.config import EngineConfig

EXTRA_CONFIG_KEYS = (
    "cpu_bytes_to_use",
    "num_cpu_blocks",
    "block_size",
    "eviction_policy",
    "spec_name",
)
EVICTION_POLICIES = ("lru",)
SPEC_NAMES = ("CPUOffloadingSpec",)


def host_block_bytes(config: EngineConfig) -> int:
    """Bytes one host block takes: every layer's keys and values of one cache block (a
    latent cache's one tensor, ``planned_kv_geometry``), in the cache's dtype."""
    from pagedlm.kv_cache.fp8 import kv_cache_torch_dtype
    from pagedlm.worker.latent_kv import planned_kv_geometry

    geometry = planned_kv_geometry(config)
    return kv_bytes_per_block(
        config.cache.block_size,
        config.model.arch.num_hidden_layers,
        geometry.num_kv_heads,
        geometry.head_dim,
        kv_cache_torch_dtype(config.cache.cache_dtype, config.model.dtype),
        shares_values=geometry.shares_values,
    )


def num_host_blocks(config: EngineConfig) -> int:
    """The pool's size in blocks: ``num_cpu_blocks``, or ``cpu_bytes_to_use`` over the
    bytes of one block (``check_config`` has refused anything else)."""
    assert config.kv_transfer is not None
    extra = config.kv_transfer.kv_connector_extra_config
    if extra.get("num_cpu_blocks"):  # 0 beside a byte budget: unset, as check_config reads it
        return int(extra["num_cpu_blocks"])
    return int(extra["cpu_bytes_to_use"]) // host_block_bytes(config)


def check_extra_config(config: EngineConfig) -> None:
    """ValueError naming the fix for extra-config keys the connector does not honour."""
    check_extra_config_keys(config, EXTRA_CONFIG_KEYS)
    assert config.kv_transfer is not None
    extra = config.kv_transfer.kv_connector_extra_config
    name = config.kv_transfer.kv_connector
    size_keys = [key for key in ("cpu_bytes_to_use", "num_cpu_blocks") if extra.get(key)]
    if len(size_keys) != 1:
        raise ValueError(
            f"{name} needs the host pool's size: kv_connector_extra_config cpu_bytes_to_use "
            "(bytes) or num_cpu_blocks (blocks), one of them, e.g. "
            '{"cpu_bytes_to_use": 4294967296}; or start with --kv-offloading-size <GiB> '
            "instead of kv_transfer_config."
        )
    value = extra[size_keys[0]]
    valid = isinstance(value, (int, float)) and not isinstance(value, bool)
    if size_keys[0] == "num_cpu_blocks":
        valid = valid and float(value).is_integer()
    if not valid or not math.isfinite(value) or value <= 0:
        what = "a positive whole number" if size_keys[0] == "num_cpu_blocks" else "positive"
        raise ValueError(f"kv_connector_extra_config {size_keys[0]} must be {what}, got {value!r}.")
    block_size = extra.get("block_size", config.cache.block_size)
    if block_size != config.cache.block_size:
        raise ValueError(
            f"kv_connector_extra_config block_size={block_size!r}: pagedlm's {name} keeps "
            f"host blocks of the cache's block_size ({config.cache.block_size}); drop "
            "block_size or set it to the cache's."
        )
    policy = extra.get("eviction_policy", "lru")
    if policy not in EVICTION_POLICIES:
        raise ValueError(
            f"kv_connector_extra_config eviction_policy={policy!r} is not supported; "
            f"pagedlm's {name} evicts the least recently used block: use 'lru' or drop it."
        )
    spec = extra.get("spec_name", SPEC_NAMES[0])
    if spec not in SPEC_NAMES:
        raise ValueError(
            f"kv_connector_extra_config spec_name={spec!r}: pagedlm's {name} has only "
            f"{list(SPEC_NAMES)} (host memory); drop spec_name."
        )
