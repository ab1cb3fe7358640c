"""What every executor with worker processes shares: the broadcast, the replies, failures.

The executor binds two ZMQ sockets: an XPUB socket that broadcasts each ``WorkerCall``
to every rank (encoded once per step), and a PULL socket on which workers push their
replies. ``execute_model`` and ``sample_tokens`` are one broadcast each and never wait;
``sample_tokens`` returns a handle whose ``result()`` waits for the output rank's
``ModelRunnerOutput`` of that step. An empty step is broadcast (the workers drop finished
requests) but has no sampling and no reply.

``collective_rpc`` is a broadcast too (the call encoded by ``pagedlm.worker.rpc_codec``),
answered by every rank with an ``RpcResult`` carrying the call's id: step outputs that
arrive meanwhile are kept for their handles, and late answers to an earlier call that
timed out are dropped. A rank whose method raised answers with the error and carries on.

Failures: every wait polls in slices of ``LIVENESS_POLL_S`` and asks the subclass which
workers died; a dead worker, or one that reports ``Failed``, marks the executor failed,
and that and every later call raise ``WorkerDiedError`` at once. The engine core lets it
propagate, so its waiters fail as when the engine core itself dies.

Subclasses start the workers (``_start_workers``) and say which are dead
(``_dead_workers``) and how to stop them (``_stop_workers``).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import time
from abc import abstractmethod
from typing import TYPE_CHECKING, Any

import zmq

from pagedlm.executor import worker_messages as wire
from pagedlm.executor.interface import Executor
from pagedlm.step import (
    FinishedStep,
    GrammarBitmask,
    ModelRunnerOutput,
    SchedulerOutput,
    StepResult,
    codec,
)
from pagedlm.worker import rpc_codec
from pagedlm.worker.rpc import RpcMethod, WorkerRpcError, check_call, failure_message, method_label

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    import torch

    from pagedlm.config import EngineConfig
    from pagedlm.platforms import Platform

logger = logging.getLogger(__name__)

LIVENESS_POLL_S = 0.1
"""Longest a wait for workers goes without checking that they are alive."""
READY_TIMEOUT_S = 900.0
"""Loading a large model on every rank may take minutes."""
SHUTDOWN_TIMEOUT_S = 5.0


class WorkerDiedError(RuntimeError):
    """A worker process died or failed; the engine cannot continue."""


class _RemoteStep:
    """A launched step on the workers; ``result()`` waits for the output rank's reply."""

    def __init__(self, executor: DistributedExecutor, step_id: int) -> None:
        self.executor, self.step_id = executor, step_id

    def result(self) -> ModelRunnerOutput:
        return self.executor._wait_output(self.step_id)


class DistributedExecutor(Executor):
    """An executor whose ``world_size`` workers live in processes of their own."""

    def __init__(self, config: EngineConfig, platform: Platform) -> None:
        super().__init__(config, platform)
        parallel = config.parallel
        self.world_size = parallel.world_size
        self._context = zmq.Context()
        self._calls = self._context.socket(zmq.XPUB)
        self._calls.setsockopt(zmq.XPUB_VERBOSE, 1)  # one subscription message per worker
        self._calls.setsockopt(zmq.SNDHWM, 0)
        self._calls.setsockopt(zmq.LINGER, 0)
        self._replies = self._context.socket(zmq.PULL)
        self._replies.setsockopt(zmq.RCVHWM, 0)
        self._replies.setsockopt(zmq.LINGER, 0)
        self._step_ids = itertools.count()
        self._rpc_ids = itertools.count()
        self._outputs: dict[int, ModelRunnerOutput] = {}
        self._last_step_empty = True
        self._failure: str | None = None
        self._closed = False
        self._model_path = config.model.model
        """The checkpoint the workers' weights came from (``reload_weights`` changes it)."""
        try:
            broadcast_address, reply_address = self._bind(self._calls, self._replies)
            self._start_workers(broadcast_address, reply_address, wire.encode_config(config))
            self._wait_subscribed()
            self._gather(wire.Ready, READY_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        atexit.register(self.shutdown)  # an engine never shut down still stops its workers

    # ---- subclass hooks -----------------------------------------------------------

    @abstractmethod
    def _bind(self, calls: zmq.Socket, replies: zmq.Socket) -> tuple[str, str]:
        """Bind both sockets; return the (broadcast, reply) addresses workers connect to."""

    @abstractmethod
    def _start_workers(self, broadcast_address: str, reply_address: str, config: bytes) -> None:
        """Start one worker per rank with a ``WorkerSpec`` holding these (returns at once)."""

    @abstractmethod
    def _dead_workers(self) -> list[str]:
        """A description of each worker that is no longer running (empty: all alive)."""

    @abstractmethod
    def _stop_workers(self, timeout_s: float) -> None:
        """Make sure no worker runs any more (after ``Shutdown`` was broadcast)."""

    # ---- the Executor interface ---------------------------------------------------

    @property
    def max_concurrent_batches(self) -> int:
        return self.config.parallel.pipeline_parallel_size

    def determine_num_kv_blocks(self) -> int:
        self._broadcast(wire.DetermineKvBlocks())
        replies = self._gather(wire.KvBlocks, READY_TIMEOUT_S)
        return min(reply.num_blocks for reply in replies)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._broadcast(wire.InitializeKvCache(num_blocks))
        self._gather(wire.Done, READY_TIMEOUT_S)

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self._last_step_empty = scheduler_output.is_empty
        self._broadcast(wire.ExecuteModel(), codec.encode(scheduler_output))

    def sample_tokens(self, grammar_bitmask: GrammarBitmask | None) -> StepResult:
        if self._last_step_empty:
            self._check_alive()
            return FinishedStep(ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
        step_id = next(self._step_ids)
        payload = b"" if grammar_bitmask is None else codec.encode(grammar_bitmask)
        self._broadcast(wire.SampleTokens(step_id, grammar_bitmask is not None), payload)
        return _RemoteStep(self, step_id)

    def sleep(self, level: int) -> None:
        self._admin(wire.Sleep(level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._admin(wire.WakeUp(None if tags is None else list(tags)))

    def reload_weights(
        self, model_path: str | None, weights: Iterable[tuple[str, torch.Tensor]] | None
    ) -> None:
        if model_path is None:
            raise NotImplementedError(
                f"the {self.name!r} executor's workers run in other processes, which tensors "
                "given here do not reach; save them and update_weights_from_disk instead"
            )
        try:
            self._admin(wire.ReloadWeights(model_path))
        except ValueError:
            # The ranks that loaded the new weights go back too: all ranks hold one model.
            self._admin(wire.ReloadWeights(self._model_path))
            raise
        self._model_path = model_path

    def collective_rpc(
        self,
        method: RpcMethod,
        timeout: float | None,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
    ) -> list[Any]:
        check_call(method, timeout)
        payload = rpc_codec.encode_call(method, args, kwargs)  # TypeError: nothing sent
        call_id = next(self._rpc_ids)
        label = method_label(method)
        self._broadcast(wire.CollectiveRpc(call_id), payload)
        answers = self._gather_rpc(call_id, label, timeout)
        failed = [rank for rank, (reply, _) in enumerate(answers) if reply.error is not None]
        if failed:
            first = answers[failed[0]][0]
            message = failure_message(label, failed, first.error or "")
            raise WorkerRpcError(f"{message}\n{first.traceback}".rstrip(), failed[0], label)
        return [rpc_codec.decode_value(result) for _, result in answers]

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        with contextlib.suppress(zmq.ZMQError):
            self._calls.send(wire.encode(wire.Shutdown()), flags=zmq.NOBLOCK)
        try:
            # After a failure nothing is left to finish: stop the rest at once, so that
            # whoever waits for this shutdown (the engine reporting its death) does not.
            self._stop_workers(0.0 if self._failure is not None else SHUTDOWN_TIMEOUT_S)
        finally:
            self._calls.close(linger=0)
            self._replies.close(linger=0)
            self._context.destroy(linger=0)

    # ---- messages -----------------------------------------------------------------

    def _broadcast(self, call: wire.WorkerCall, payload: bytes | None = None) -> None:
        self._check_alive()
        header = wire.encode(call)
        if payload is None:
            self._calls.send(header)
        else:
            self._calls.send_multipart([header, payload], copy=False)

    def _admin(self, call: wire.WorkerCall) -> None:
        """Broadcast an admin call and wait for every rank; ``ValueError`` (the first
        refusal's message) if any rank declined it."""
        self._broadcast(call)
        replies = self._gather((wire.Done, wire.Refused), READY_TIMEOUT_S)
        refused = [reply for reply in replies if isinstance(reply, wire.Refused)]
        if refused:
            raise ValueError(refused[0].message)

    def _gather_rpc(
        self, call_id: int, label: str, timeout: float | None
    ) -> list[tuple[wire.RpcResult, bytes]]:
        """Every rank's ``RpcResult`` of call ``call_id`` (and its result frame), by rank."""
        deadline = None if timeout is None else time.monotonic() + timeout
        answers: dict[int, tuple[wire.RpcResult, bytes]] = {}
        while len(answers) < self.world_size:
            try:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError
                reply, frames = self._receive(deadline)
            except TimeoutError:
                missing = [rank for rank in range(self.world_size) if rank not in answers]
                raise TimeoutError(
                    f"collective_rpc {label!r}: worker ranks {missing} did not answer within "
                    f"{timeout:g} s. The call goes on running there, and the workers take "
                    "their next call (a step too) after it; pass a larger timeout."
                ) from None
            if isinstance(reply, wire.RpcResult) and reply.call_id == call_id:
                result = bytes(frames[1].buffer) if reply.error is None else b""
                answers[reply.rank] = (reply, result)
            elif isinstance(reply, wire.StepOutput):  # a step in flight, kept for its handle
                self._outputs[reply.step_id] = codec.decode(frames[1].buffer, ModelRunnerOutput)
            elif isinstance(reply, wire.RpcResult):
                logger.info("dropping rank %d's late answer to a timed-out call", reply.rank)
            else:
                logger.warning("ignoring %s while waiting for collective_rpc", type(reply).__name__)
        return [answers[rank] for rank in sorted(answers)]

    def _wait_output(self, step_id: int) -> ModelRunnerOutput:
        """The output rank's result of step ``step_id`` (earlier ones are kept until
        their handles ask)."""
        while step_id not in self._outputs:
            reply, frames = self._receive(deadline=None)
            if isinstance(reply, wire.StepOutput):
                self._outputs[reply.step_id] = codec.decode(frames[1].buffer, ModelRunnerOutput)
            else:
                logger.warning("ignoring %s from a worker mid-step", type(reply).__name__)
        return self._outputs.pop(step_id)

    def _gather(self, kind: type | tuple[type, ...], timeout_s: float) -> list:
        """One ``kind`` reply (or one of the ``kind`` types) from every rank."""
        deadline = time.monotonic() + timeout_s
        replies: dict[int, object] = {}
        while len(replies) < self.world_size:
            reply, _ = self._receive(deadline)
            if isinstance(reply, kind):
                replies[reply.rank] = reply
            else:
                logger.warning("ignoring %s while waiting for %s", type(reply).__name__, kind)
        return [replies[rank] for rank in sorted(replies)]

    def _receive(self, deadline: float | None) -> tuple[wire.WorkerReply, list]:
        """The next reply; raises ``WorkerDiedError`` when a worker dies or fails, and
        ``TimeoutError`` past ``deadline``."""
        while True:
            self._check_alive()
            if self._replies.poll(int(LIVENESS_POLL_S * 1000)):
                frames = self._replies.recv_multipart(copy=False)
                reply = wire.decode_reply(frames[0].buffer)
                if isinstance(reply, wire.Failed):
                    self._fail(f"worker rank {reply.rank} failed:\n{reply.message}")
                return reply, frames
            dead = self._dead_workers()
            if dead:
                self._fail("; ".join(dead))
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    f"the workers did not answer within the start-up timeout; {self._who()}"
                )

    def _wait_subscribed(self) -> None:
        """Wait until every worker's subscription reached the broadcast socket: a call
        sent before that would be lost to it."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        subscribed = 0
        while subscribed < self.world_size:
            if self._calls.poll(int(LIVENESS_POLL_S * 1000)):
                if self._calls.recv()[:1] == b"\x01":
                    subscribed += 1
                continue
            dead = self._dead_workers()
            if dead:
                self._fail("; ".join(dead))
            self._check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the workers did not connect; {self._who()}")

    def _who(self) -> str:
        return f"{self.world_size} workers of {type(self).__name__}"

    def _fail(self, description: str) -> None:
        if self._failure is None:
            self._failure = description
            logger.error("executor: %s", description)
        self._check_alive()

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise WorkerDiedError(f"A worker of the engine died: {self._failure}")
        if self._closed:
            raise WorkerDiedError("The executor has been shut down.")
