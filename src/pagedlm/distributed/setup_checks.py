"""Start-up decisions and checks for distributed execution, made once at the edge.

``resolve_executor_backend`` follows vLLM's defaulting rules; the ``check_*`` functions
raise ``ValueError`` naming the flag to change before any process or device is touched.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedlm.config import ArchConfig, ParallelConfig
    from pagedlm.platforms import Platform

RAY_INSTALL_HINT = "pip install 'pagedlm[ray]'"
ONE_WORKER_BACKENDS = ("uni",)
"""Executors that run exactly one worker (in the engine's own process)."""


def ray_is_installed() -> bool:
    return importlib.util.find_spec("ray") is not None


def import_ray() -> Any:
    """The ``ray`` module, or a ``ValueError`` that says how to install it."""
    try:
        import ray
    except ImportError as error:
        raise ValueError(
            f"distributed_executor_backend='ray' needs Ray, which is not installed ({error}); "
            f"install it with {RAY_INSTALL_HINT}, or use distributed_executor_backend='mp' on "
            "one node."
        ) from None
    return ray


def check_worker_transport(backend: str) -> None:
    """Executors with worker processes need pyzmq and msgspec (not core dependencies)."""
    if backend not in ("mp", "ray"):
        return
    missing = [m for m in ("zmq", "msgspec") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(
            f"distributed_executor_backend={backend!r} needs {' and '.join(missing)}; install "
            "them with pip install 'pagedlm[distributed]'."
        )


def _in_ray_placement_group() -> bool:
    """Whether this process is a Ray task or actor inside a placement group (only asked
    when Ray is already imported: importing it just to ask costs seconds)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return False
    from ray.util import get_current_placement_group

    return get_current_placement_group() is not None


def resolve_executor_backend(
    requested: str | None,
    world_size: int,
    data_parallel_size: int,
    platform: Platform,
) -> str:
    """The executor to use.

    vLLM's rules: a backend the user names wins; one worker runs in-process (the
    platform's default, "uni"); more than one runs a process per rank ("mp") unless the
    node has fewer devices than ranks or this process lives in a Ray placement group
    ("ray"). Data-parallel replicas on a device platform get a worker process each, so
    that each holds its own device.
    """
    if requested is not None:
        if requested in ONE_WORKER_BACKENDS and world_size > 1:
            raise ValueError(
                f"distributed_executor_backend={requested!r} runs one worker, but "
                f"tensor_parallel_size x pipeline_parallel_size = {world_size}; use 'mp' (one "
                "node) or 'ray'."
            )
        return requested
    devices = platform.device_count()
    if world_size == 1:
        if data_parallel_size > 1 and devices is not None:
            return "mp"
        return platform.default_executor
    if devices is not None and devices < world_size:
        if not ray_is_installed():
            raise ValueError(
                f"{world_size} ranks need {world_size} {platform.name} devices but this node "
                f"has {devices}; running across nodes needs Ray ({RAY_INSTALL_HINT}), "
                "otherwise lower tensor_parallel_size or pipeline_parallel_size."
            )
        return "ray"
    if _in_ray_placement_group():
        return "ray"
    return "mp"


def check_devices(parallel: ParallelConfig, platform: Platform) -> None:
    """Single-node executors need a device per rank (every replica's ranks on this node)."""
    devices = platform.device_count()
    if devices is None or parallel.distributed_executor_backend == "ray":
        return
    if parallel.data_parallel_size > 1 and parallel.distributed_executor_backend == "uni":
        raise ValueError(
            f"data_parallel_size={parallel.data_parallel_size} with the 'uni' executor would "
            f"put every replica on one {platform.name} device; use "
            "distributed_executor_backend='mp' (the default) so each replica gets its own."
        )
    # Every replica runs on this node (``pagedlm.engine.data_parallel``).
    needed = max(
        parallel.first_local_device + parallel.world_size,
        parallel.data_parallel_size * parallel.world_size,
    )
    if needed > devices:
        raise ValueError(
            f"data_parallel_size={parallel.data_parallel_size} (rank "
            f"{parallel.data_parallel_rank}) x tensor_parallel_size="
            f"{parallel.tensor_parallel_size} x pipeline_parallel_size="
            f"{parallel.pipeline_parallel_size} needs {needed} {platform.name} devices on this "
            f"node but {devices} are visible; lower the parallel sizes, or use "
            "distributed_executor_backend='ray' across nodes."
        )


def check_dist_backend(parallel: ParallelConfig, platform: Platform) -> None:
    """The platform's torch.distributed backend must exist in this torch build."""
    if parallel.world_size == 1:
        return
    import torch.distributed as dist

    backend = platform.dist_backend
    if not dist.is_available() or not dist.is_backend_available(backend):
        raise ValueError(
            f"tensor/pipeline parallelism on {platform.name} needs the torch.distributed "
            f"backend {backend!r}, which this torch build lacks; install a torch build with "
            f"{backend} support, or set tensor_parallel_size=pipeline_parallel_size=1."
        )


def _num_experts(arch: ArchConfig) -> int:
    raw = arch.raw
    return int(raw.get("num_local_experts") or raw.get("num_experts") or 0)


def check_model_fits(arch: ArchConfig, parallel: ParallelConfig) -> None:
    """Heads, KV heads, MLP widths, experts and layers must split over the ranks."""
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    fix = "choose a tensor_parallel_size that divides it"
    if arch.num_attention_heads % tp:
        raise ValueError(
            f"num_attention_heads={arch.num_attention_heads} is not divisible by "
            f"tensor_parallel_size={tp}; {fix}."
        )
    kv = arch.num_key_value_heads
    if kv % tp and tp % kv:
        raise ValueError(
            f"num_key_value_heads={kv} and tensor_parallel_size={tp}: one must divide the "
            f"other (KV heads are split, or replicated over ranks); {fix}."
        )
    if arch.intermediate_size % tp:
        raise ValueError(
            f"intermediate_size={arch.intermediate_size} is not divisible by "
            f"tensor_parallel_size={tp}; {fix}."
        )
    experts = _num_experts(arch)
    if experts and parallel.enable_expert_parallel and experts % tp:
        raise ValueError(
            f"{experts} experts do not split over tensor_parallel_size={tp} ranks with "
            f"enable_expert_parallel; {fix}, or turn expert parallelism off."
        )
    moe_size = int(arch.raw.get("moe_intermediate_size") or arch.intermediate_size)
    if experts and not parallel.enable_expert_parallel and moe_size % tp:
        raise ValueError(
            f"moe_intermediate_size={moe_size} is not divisible by tensor_parallel_size={tp}; "
            f"{fix}, or pass enable_expert_parallel=True to shard whole experts."
        )
    if parallel.enable_expert_parallel and not experts:
        raise ValueError(
            f"enable_expert_parallel needs a mixture-of-experts model; {arch.architecture} "
            "has no experts. Drop the flag."
        )
    if pp > arch.num_hidden_layers:
        raise ValueError(
            f"pipeline_parallel_size={pp} exceeds the model's {arch.num_hidden_layers} layers; "
            "use at most one stage per layer."
        )
