"""The multiprocess executor: one worker process per rank on this node (vLLM's "mp").

Each worker is a fresh interpreter (``python -m pagedlm.executor.worker_proc``, so it
inherits no threads and nothing is pickled) that takes device
``first_local_device + rank``. The broadcast and reply sockets are IPC paths in a private
directory (mode 0700); ranks meet for ``torch.distributed`` on a free loopback port.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from typing import TYPE_CHECKING

import msgspec
import zmq

from pagedlm.executor import worker_messages as wire
from pagedlm.executor.distributed import DistributedExecutor

if TYPE_CHECKING:
    from pagedlm.config import EngineConfig
    from pagedlm.platforms import Platform

THREADS_ENV = "OMP_NUM_THREADS"


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask: taskset, container CPU sets),
    which its workers inherit."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def describe_exit(rank: int, status: int) -> str:
    if status < 0:
        return f"worker rank {rank} was killed by signal {-status}"
    return f"worker rank {rank} exited with status {status}"


class MultiprocExecutor(DistributedExecutor):
    name = "mp"

    def __init__(self, config: EngineConfig, platform: Platform) -> None:
        self._processes: list[subprocess.Popen] = []
        self._ipc_dir = tempfile.mkdtemp(prefix="pagedlm-workers-")  # mode 0700
        super().__init__(config, platform)

    def _bind(self, calls: zmq.Socket, replies: zmq.Socket) -> tuple[str, str]:
        broadcast, reply = f"ipc://{self._ipc_dir}/calls", f"ipc://{self._ipc_dir}/replies"
        calls.bind(broadcast)
        replies.bind(reply)
        return broadcast, reply

    def _worker_env(self) -> dict[str, str]:
        env = dict(os.environ)
        # The node's cores are shared by every rank of every replica: one OpenMP pool each
        # of the full size would oversubscribe them many times over.
        if THREADS_ENV not in env:
            parallel = self.config.parallel
            ranks = parallel.world_size * parallel.data_parallel_size
            env[THREADS_ENV] = str(max(1, usable_cores() // ranks))
        return env

    def _start_workers(self, broadcast_address: str, reply_address: str, config: bytes) -> None:
        init_method = f"tcp://127.0.0.1:{free_loopback_port()}"
        first_device = self.config.parallel.first_local_device
        env = self._worker_env()
        for rank in range(self.world_size):
            spec = wire.WorkerSpec(
                rank=rank,
                local_rank=first_device + rank,
                distributed_init_method=init_method,
                broadcast_address=broadcast_address,
                reply_address=reply_address,
                parent_pid=os.getpid(),
                die_with_parent=threading.current_thread() is threading.main_thread(),
                config=msgspec.Raw(config),
            )
            process = subprocess.Popen(
                [sys.executable, "-m", "pagedlm.executor.worker_proc"],
                stdin=subprocess.PIPE,
                env=env,
            )
            self._processes.append(process)
            assert process.stdin is not None
            process.stdin.write(wire.encode_spec(spec))
            process.stdin.close()

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the workers, by rank (for monitoring and fault tests)."""
        return [process.pid for process in self._processes]

    def _dead_workers(self) -> list[str]:
        return [
            describe_exit(rank, status)
            for rank, process in enumerate(self._processes)
            if (status := process.poll()) is not None
        ]

    def _stop_workers(self, timeout_s: float) -> None:
        try:
            for escalate in (None, subprocess.Popen.terminate, subprocess.Popen.kill):
                alive = [p for p in self._processes if p.poll() is None]
                if not alive:
                    break
                if escalate is not None:
                    for process in alive:
                        with contextlib.suppress(ProcessLookupError):
                            escalate(process)
                for process in alive:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        process.wait(timeout_s)
            for process in self._processes:
                process.wait()
        finally:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
