"""The Ray executor: the multiprocess executor's workers as Ray actors (vLLM's "ray").

Ray only places and starts the workers: a placement group reserves one bundle per rank
(a GPU each on device platforms, a CPU each otherwise, packed onto as few nodes as
possible), one actor per bundle runs ``worker_proc.run_worker``, and from then on the
executor talks to the workers exactly as the multiprocess executor does (broadcast and
replies over ZMQ, msgspec). When every bundle landed on this node the sockets are IPC
paths in a private directory; across nodes they are TCP ports on this node's address
(``PAGEDLM_HOST_IP``, else Ray's idea of it), which every node must reach. Ranks meet for
``torch.distributed`` at rank 0's node.

Ray is joined with ``ray.init()`` if this process is not connected yet (``RAY_ADDRESS``
names an existing cluster); a cluster this executor started is shut down with it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from pagedlm.distributed.setup_checks import import_ray
from pagedlm.executor import worker_messages as wire
from pagedlm.executor.distributed import READY_TIMEOUT_S, DistributedExecutor

if TYPE_CHECKING:
    from pagedlm.config import EngineConfig
    from pagedlm.platforms import Platform

HOST_IP_ENV = "PAGEDLM_HOST_IP"
"""The address other nodes reach this one at (multi-node Ray only)."""


class _RayWorker:
    """The actor: reports where it runs, then serves its rank until shut down."""

    def where(self) -> tuple[str, str, list[str], int]:
        """(node id, node address, visible GPU ids, a free port on this node)."""
        import ray

        context = ray.get_runtime_context()
        gpu_ids = [str(gpu) for gpu in ray.get_gpu_ids()]
        return context.get_node_id(), ray.util.get_node_ip_address(), gpu_ids, _free_port()

    def run(self, spec: bytes, env: dict[str, str]) -> int:
        from pagedlm.executor.worker_proc import run_worker

        os.environ.update(env)
        return run_worker(wire.decode_spec(spec))


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


class RayExecutor(DistributedExecutor):
    name = "ray"

    def __init__(self, config: EngineConfig, platform: Platform) -> None:
        self._ray = import_ray()
        self._started_ray = False
        self._actors: list[Any] = []
        self._runs: list[Any] = []
        self._placement_group: Any = None
        self._ipc_dir: str | None = None
        super().__init__(config, platform)

    # ---- placement ----------------------------------------------------------------

    def _bind(self, calls: zmq.Socket, replies: zmq.Socket) -> tuple[str, str]:
        ray = self._ray
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
            self._started_ray = True
        uses_devices = self.platform.device_count() is not None
        bundle = {"GPU": 1.0, "CPU": 1.0} if uses_devices else {"CPU": 1.0}
        total = ray.cluster_resources()
        for resource, amount in bundle.items():
            if total.get(resource, 0) < amount * self.world_size:
                raise RuntimeError(
                    f"{self.world_size} workers need {amount * self.world_size:g} {resource} "
                    f"but the Ray cluster has {total.get(resource, 0):g}; add nodes (ray start "
                    "--address=...) or lower tensor_parallel_size or pipeline_parallel_size."
                )
        from ray.util.placement_group import placement_group

        self._placement_group = placement_group([bundle] * self.world_size, strategy="PACK")
        try:
            ray.get(self._placement_group.ready(), timeout=READY_TIMEOUT_S)
        except Exception as error:
            raise RuntimeError(
                f"Ray could not place {self.world_size} workers of {bundle} within "
                f"{READY_TIMEOUT_S:.0f} s ({error}); check `ray status` for free resources."
            ) from None
        self._create_actors(bundle)
        self._where = ray.get([actor.where.remote() for actor in self._actors])
        this_node = ray.get_runtime_context().get_node_id()
        if all(node == this_node for node, *_ in self._where):
            self._ipc_dir = tempfile.mkdtemp(prefix="pagedlm-workers-")  # mode 0700
            broadcast, reply = f"ipc://{self._ipc_dir}/calls", f"ipc://{self._ipc_dir}/replies"
            calls.bind(broadcast)
            replies.bind(reply)
            return broadcast, reply
        host = os.environ.get(HOST_IP_ENV) or ray.util.get_node_ip_address()
        broadcast_port = calls.bind_to_random_port(f"tcp://{host}")
        reply_port = replies.bind_to_random_port(f"tcp://{host}")
        return f"tcp://{host}:{broadcast_port}", f"tcp://{host}:{reply_port}"

    def _create_actors(self, bundle: dict[str, float]) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor_class = self._ray.remote(_RayWorker)
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self._placement_group, placement_group_bundle_index=rank
            )
            options = {"num_cpus": bundle["CPU"], "num_gpus": bundle.get("GPU", 0)}
            actor = actor_class.options(scheduling_strategy=strategy, **options).remote()
            self._actors.append(actor)

    def _start_workers(self, broadcast_address: str, reply_address: str, config: bytes) -> None:
        _, rank0_address, _, rank0_port = self._where[0]
        init_method = f"tcp://{rank0_address}:{rank0_port}"
        # Each node's workers see all of that node's GPUs (NCCL then uses peer-to-peer
        # paths between them), and each takes its own by index.
        node_gpus: dict[str, list[str]] = {}
        for node, _, gpu_ids, _ in self._where:
            node_gpus.setdefault(node, []).extend(gpu_ids)
        for rank, (actor, (node, _, gpu_ids, _)) in enumerate(zip(self._actors, self._where)):
            visible = sorted(set(node_gpus[node]), key=lambda g: (len(g), g))
            env = {"CUDA_VISIBLE_DEVICES": ",".join(visible)} if visible else {}
            local_rank = visible.index(gpu_ids[0]) if gpu_ids else rank
            spec = wire.WorkerSpec(
                rank=rank,
                local_rank=local_rank,
                distributed_init_method=init_method,
                broadcast_address=broadcast_address,
                reply_address=reply_address,
                parent_pid=0,  # Ray ends actors whose driver exits
                die_with_parent=False,
                config=msgspec.Raw(config),
            )
            self._runs.append(actor.run.remote(wire.encode_spec(spec), env))

    # ---- liveness and shutdown ------------------------------------------------------

    def _dead_workers(self) -> list[str]:
        if not self._runs:
            return []
        finished, _ = self._ray.wait(self._runs, num_returns=len(self._runs), timeout=0)
        dead = []
        for ref in finished:
            rank = self._runs.index(ref)
            try:
                status = self._ray.get(ref)
                dead.append(f"worker rank {rank} (a Ray actor) exited with status {status}")
            except Exception as error:
                dead.append(f"worker rank {rank} (a Ray actor) died: {type(error).__name__}")
        return dead

    def _stop_workers(self, timeout_s: float) -> None:
        ray = self._ray
        try:
            if self._runs:
                ray.wait(self._runs, num_returns=len(self._runs), timeout=timeout_s)
            for actor in self._actors:
                ray.kill(actor)
            if self._placement_group is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self._placement_group)
        finally:
            if self._ipc_dir is not None:
                shutil.rmtree(self._ipc_dir, ignore_errors=True)
            if self._started_ray:
                ray.shutdown()
