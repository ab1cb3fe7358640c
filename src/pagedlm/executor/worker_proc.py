"""A worker process: one rank of a multi-process (or Ray) executor.

Started as ``python -m pagedlm.executor.worker_proc`` with a ``WorkerSpec`` as JSON on
stdin (a Ray actor calls ``run_worker`` with it). The worker subscribes to the executor's
broadcast, builds its rank's model, says ``Ready`` and then applies every ``WorkerCall``
in order (a ``collective_rpc`` call too: it answers with the method's result or its
error, and carries on). The output rank hands each step's ``StepResult`` to a sender
thread, which waits for the device and pushes the ``ModelRunnerOutput``; the main thread
meanwhile takes the next call, so a step in flight never holds up the launch of the next
one.

Exits: on ``Shutdown``; with status 1 after reporting ``Failed`` on any exception; and on
its own when the engine process goes away (it polls the parent's pid, and on Linux, when
the engine's main thread started it, asks the kernel to kill it with its parent: a worker
blocked in a collective cannot poll).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import signal
import sys
import threading
import traceback
from collections.abc import Callable

import zmq

from pagedlm.executor import worker_messages as wire
from pagedlm.gc_heap import freeze_startup_heap
from pagedlm.logging_config import configure_logging
from pagedlm.step import GrammarBitmask, SchedulerOutput, StepResult, codec
from pagedlm.worker import rpc_codec
from pagedlm.worker.extension import make_worker
from pagedlm.worker.rpc import run_on_worker
from pagedlm.worker.worker import RankPlacement, Worker

logger = logging.getLogger(__name__)

PARENT_POLL_MS = 500
"""How often an idle worker checks that the engine process is alive."""


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when its parent exits (a worker stuck
    in a collective cannot poll)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class _OutputSender(threading.Thread):
    """Waits for each step's result in launch order and pushes it to the executor."""

    def __init__(self, context: zmq.Context, address: str, rank: int) -> None:
        super().__init__(name="pagedlm-output-sender", daemon=True)
        self.context, self.address, self.rank = context, address, rank
        self.steps: queue.SimpleQueue[tuple[int, StepResult] | None] = queue.SimpleQueue()
        self.error: str | None = None

    def run(self) -> None:
        socket = self.context.socket(zmq.PUSH)
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.connect(self.address)
        try:
            while (item := self.steps.get()) is not None:
                step_id, result = item
                try:
                    payload = codec.encode(result.result())
                except Exception:
                    self.error = traceback.format_exc()
                    socket.send(wire.encode(wire.Failed(self.rank, self.error)))
                    return
                socket.send_multipart([wire.encode(wire.StepOutput(step_id)), payload], copy=False)
        finally:
            socket.close(linger=1000)


class WorkerLoop:
    """Applies the executor's calls to one ``Worker`` until ``Shutdown``."""

    def __init__(
        self, worker: Worker, calls: zmq.Socket, replies: zmq.Socket, spec: wire.WorkerSpec
    ) -> None:
        self.worker, self.calls, self.replies, self.spec = worker, calls, replies, spec
        self.sender: _OutputSender | None = None
        if worker.is_output_rank:
            self.sender = _OutputSender(calls.context, spec.reply_address, spec.rank)
            self.sender.start()

    def run(self) -> None:
        try:
            while self._handle_next():
                pass
        finally:
            if self.sender is not None:
                self.sender.steps.put(None)
                self.sender.join(timeout=5)

    def _handle_next(self) -> bool:
        while not self.calls.poll(PARENT_POLL_MS):
            if self.spec.parent_pid and os.getppid() != self.spec.parent_pid:
                logger.warning("worker %d: the engine process is gone; exiting", self.spec.rank)
                return False
        if self.sender is not None and self.sender.error is not None:
            raise RuntimeError(f"collecting a step failed:\n{self.sender.error}")
        frames = self.calls.recv_multipart(copy=False)
        call = wire.decode_call(frames[0].buffer)
        worker, rank = self.worker, self.spec.rank
        if isinstance(call, wire.ExecuteModel):
            worker.execute_model(codec.decode(frames[1].buffer, SchedulerOutput))
        elif isinstance(call, wire.SampleTokens):
            bitmask = codec.decode(frames[1].buffer, GrammarBitmask) if call.has_bitmask else None
            result = worker.sample_tokens(bitmask)
            if self.sender is not None:
                self.sender.steps.put((call.step_id, result))
        elif isinstance(call, wire.DetermineKvBlocks):
            self._reply(wire.KvBlocks(rank, worker.determine_num_kv_blocks()))
        elif isinstance(call, wire.InitializeKvCache):
            worker.initialize_kv_cache(call.num_blocks)
            freeze_startup_heap(f"worker {rank}")  # start-up ends with the KV cache
            self._reply(wire.Done(rank))
        elif isinstance(call, wire.Sleep):
            self._answer(lambda: worker.sleep(call.level))
        elif isinstance(call, wire.WakeUp):
            self._answer(lambda: worker.wake_up(call.tags))
        elif isinstance(call, wire.ReloadWeights):
            self._answer(lambda: worker.reload_weights(call.model_path))
        elif isinstance(call, wire.CollectiveRpc):
            self._answer_rpc(call.call_id, frames[1].buffer)
        elif isinstance(call, wire.Shutdown):
            return False
        return True

    def _answer_rpc(self, call_id: int, payload: memoryview) -> None:
        """Run a ``collective_rpc`` call; its result, or any exception it raises (the
        worker carries on), goes back as ``RpcResult``."""
        rank = self.spec.rank
        try:
            call = rpc_codec.decode_call(payload)
            result = rpc_codec.encode_value(
                run_on_worker(self.worker, call.method, call.args, call.kwargs)
            )
        except Exception as error:
            summary = f"{type(error).__name__}: {error}"
            self._reply(wire.RpcResult(rank, call_id, summary, traceback.format_exc()))
        else:
            header = wire.encode(wire.RpcResult(rank, call_id))
            self.replies.send_multipart([header, result], copy=False)

    def _answer(self, action: Callable[[], object]) -> None:
        """``Done``, or ``Refused`` for the ``ValueError`` of a declined admin call."""
        try:
            action()
        except ValueError as error:
            self._reply(wire.Refused(self.spec.rank, str(error)))
        else:
            self._reply(wire.Done(self.spec.rank))

    def _reply(self, message: wire.WorkerReply) -> None:
        self.replies.send(wire.encode(message))


def run_worker(spec: wire.WorkerSpec) -> int:
    """Serve one rank until shut down; returns the process's exit status."""
    from pagedlm.plugins.registry import select_attention_backend, select_platform

    context = zmq.Context()
    calls = context.socket(zmq.SUB)
    calls.setsockopt(zmq.RCVHWM, 0)
    calls.setsockopt(zmq.SUBSCRIBE, b"")
    calls.connect(spec.broadcast_address)
    replies = context.socket(zmq.PUSH)
    replies.setsockopt(zmq.SNDHWM, 0)
    replies.connect(spec.reply_address)
    status, worker = 0, None
    try:
        config = wire.decode_config(spec.config)
        platform = select_platform(config.platform)
        platform.bind_config(config)
        backend_cls = select_attention_backend(platform, config.attention_backend)
        placement = RankPlacement(spec.rank, spec.local_rank, spec.distributed_init_method)
        worker = make_worker(config, platform, backend_cls, placement)
        replies.send(wire.encode(wire.Ready(spec.rank)))
        WorkerLoop(worker, calls, replies, spec).run()
    except Exception:
        message = traceback.format_exc()
        logger.error("worker %d failed:\n%s", spec.rank, message)
        with contextlib.suppress(zmq.ZMQError):
            replies.send(wire.encode(wire.Failed(spec.rank, message)))
        status = 1
    finally:
        if worker is not None:
            with contextlib.suppress(Exception):
                worker.shutdown()
        context.destroy(linger=1000)
    return status


def main() -> int:
    # Ctrl-C reaches the whole process group; the engine decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging()  # the core's level or configuration file, from its environment
    spec = wire.decode_spec(sys.stdin.buffer.read())
    if spec.die_with_parent:
        _die_with_parent()
    if spec.parent_pid and os.getppid() != spec.parent_pid:
        return 0  # the parent died before the kernel was told
    return run_worker(spec)


def exit_now(status: int) -> None:
    """Leave without the interpreter's teardown: everything the worker owns is closed by
    now, and torch's (gloo's, OpenMP's) teardown took seconds per worker, which every
    engine shutdown waited for."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


if __name__ == "__main__":
    exit_now(main())
