"""The engine-core process: ``EngineCore`` in a busy loop behind two ZMQ sockets.

Started by ``CoreClient`` as ``python -m pagedlm.engine.core_proc INPUT OUTPUT PARENT_PID``
with a ``CoreStart`` (the ``EngineArgs``, the log level) as JSON on stdin, which it reads
after its imports (so it can be started before the front end knows them: ``core_launch``).
The loop:

- idle (no unfinished requests, or paused: ``pagedlm.core.pause``): block on the input
  socket, waking every second to check that the parent is still alive (an orphaned core
  exits on its own);
- busy: drain every pending input message without blocking, then run one step and send
  its outputs, with the scheduler's stats, as one ``CoreOutputs`` message.

A heartbeat thread (``core_heartbeat``) reports liveness every half second, also while a
step computes; the loop tells it when steps start and end and what they may compute.
A request whose grammar cannot be compiled (an error, or longer than the compile timeout)
is reported as ``RequestRejected`` rather than as an aborted output, so the front end
answers 400 before any response has started.

Any exception escaping a step is reported as ``CoreFailed`` and the process exits with
status 1; the front end then fails every waiter.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable

import msgspec
import zmq

from pagedlm.core.engine_core import EngineCore
from pagedlm.core.outputs import EngineCoreOutput
from pagedlm.engine.core_heartbeat import HeartbeatThread, InFlightWork, StepWatch
from pagedlm.engine.core_profiler import CoreProfiler
from pagedlm.engine.data_parallel import make_engine_core
from pagedlm.engine.messages import (
    AbortRequests,
    AddRequests,
    CoreFailed,
    CoreOutputs,
    CoreStart,
    Ready,
    RequestRejected,
    Shutdown,
    UtilityCall,
    UtilityResult,
    make_encoder,
    make_frontend_decoder,
    request_from_wire,
)
from pagedlm.gc_heap import freeze_startup_heap
from pagedlm.logging_config import LOG_LEVEL_ENV, LOGGING_CONFIG_ENV, configure_logging
from pagedlm.lora.request import LoRARequest
from pagedlm.structured_output.manager import grammar_failure
from pagedlm.structured_output.params import GrammarLimits
from pagedlm.worker import rpc_codec

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 1000
"""How often an idle core checks that its parent is alive."""
IDLE_WAIT_MS = 1
"""How long a core with requests but nothing to run waits for input before stepping again."""


class EngineCoreProc:
    """Serves one ``EngineCore`` over a PULL (input) and a PUSH (output) socket."""

    def __init__(
        self,
        core: EngineCore,
        input_socket: zmq.Socket,
        output_socket: zmq.Socket,
        parent_pid: int,
        watch: StepWatch,
        work: InFlightWork,
    ) -> None:
        self.core = core
        self.input_socket = input_socket
        self.output_socket = output_socket
        self.parent_pid = parent_pid
        self.watch = watch
        self.work = work
        self.encoder = make_encoder()
        self.decoder = make_frontend_decoder()
        self.flush_pending = False
        """Aborted requests whose worker state still needs one (possibly empty) step."""
        self.constrained_parent: dict[str, str] = {}
        """Child id -> user request id, for requests with a grammar (which may fail)."""
        self.profiler = CoreProfiler()

    def send(self, message: msgspec.Struct) -> None:
        self.output_socket.send(self.encoder.encode(message), copy=False)

    def run(self) -> None:
        """Loop until ``Shutdown`` arrives or the parent goes away."""
        while True:
            busy = self.core.has_work()  # a paused core waits for input, as an idle one
            if not self.handle_inputs(block=not busy):
                return
            if self.core.has_work() or self.flush_pending:
                # After an abort the stats change even when the step has no outputs; send
                # them so the front end's metrics never show freed requests as running.
                send_stats = self.flush_pending
                self.flush_pending = False
                self.watch.start(self.work.step_tokens())
                outputs = self.core.step()
                self.watch.finish()
                self.send_outputs(outputs, send_stats)
                if not outputs and self.core.has_work():
                    # A step without outputs is a prefill chunk or one where nothing could
                    # run (a request waiting for its grammar): yield briefly to new input
                    # instead of spinning.
                    self.input_socket.poll(IDLE_WAIT_MS)
            if os.getppid() != self.parent_pid:
                logger.warning("engine core: the front-end process is gone; exiting")
                return

    def send_outputs(self, outputs: list[EngineCoreOutput], send_stats: bool = False) -> None:
        self.work.update(outputs)
        outputs = self.reject_failed_grammars(outputs)
        if outputs or send_stats:
            self.send(CoreOutputs(outputs, self.core.make_stats(), time.monotonic()))

    def handle_inputs(self, block: bool) -> bool:
        """Handle every pending message (waiting for one first if ``block``); False on
        ``Shutdown`` or an orphaned core."""
        if block:
            while not self.input_socket.poll(IDLE_POLL_MS):
                if os.getppid() != self.parent_pid:
                    logger.warning("engine core: the front-end process is gone; exiting")
                    return False
        while True:
            try:
                frame = self.input_socket.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            message = self.decoder.decode(frame.buffer)
            if isinstance(message, Shutdown):
                return False
            self.handle(message)

    def handle(self, message: msgspec.Struct) -> None:
        if isinstance(message, AddRequests):
            self.add_requests(message)
        elif isinstance(message, AbortRequests):
            self.abort(message.request_ids)
        elif isinstance(message, UtilityCall):
            self.send(self.answer(message))
        else:
            raise TypeError(f"engine core: unexpected message {type(message).__name__}")

    def abort(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)
        self.work.remove(request_ids)
        for request_id in request_ids:
            self.constrained_parent.pop(request_id, None)
        self.flush_pending = True

    def add_requests(self, message: AddRequests) -> None:
        added: list[str] = []
        try:
            for wire in message.requests:
                self.core.add_request(request_from_wire(wire))
                added.append(wire.request_id)
                self.work.add(wire.request_id, len(wire.prompt_token_ids))
                if wire.sampling_params.structured_outputs is not None:
                    self.constrained_parent[wire.request_id] = message.parent_id
        except ValueError as error:
            # All children or none: a rejected request must leave no trace in the core.
            if added:
                self.abort(added)
            self.send(RequestRejected(message.parent_id, str(error)))

    def reject_failed_grammars(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """``outputs`` minus those of user requests whose grammar failed; each such request
        gets one ``RequestRejected`` instead, and its other children are aborted."""
        if not self.constrained_parent:
            return outputs
        parents = {output.req_id: self.constrained_parent.get(output.req_id) for output in outputs}
        rejected: dict[str, str] = {}
        for output in outputs:
            parent_id = parents[output.req_id]
            if parent_id is None or not output.finished:
                continue
            del self.constrained_parent[output.req_id]
            failure = grammar_failure(output.finish_reason, output.stop_reason)
            if failure is not None and not output.new_token_ids:
                rejected.setdefault(parent_id, failure)
        for parent_id, failure in rejected.items():
            siblings = [c for c, p in self.constrained_parent.items() if p == parent_id]
            if siblings:
                self.abort(siblings)
            self.send(RequestRejected(parent_id, failure))
        return [output for output in outputs if parents[output.req_id] not in rejected]

    def answer(self, call: UtilityCall) -> UtilityResult:
        if call.method == "ping":
            return UtilityResult(call.call_id)
        if call.method == "get_stats":
            return UtilityResult(call.call_id, stats=self.core.make_stats())
        if call.method == "collective_rpc":
            reply = rpc_codec.answer(self.core.collective_rpc, call.payload)
            return UtilityResult(call.call_id, payload=reply)
        admin = ADMIN_CALLS.get(call.method)
        if admin is None:
            return UtilityResult(call.call_id, error=f"unknown utility method {call.method!r}")
        try:
            value = admin(self, *call.args)
        except (ValueError, NotImplementedError) as error:
            # The caller's mistake (busy, wrong level, unsupported): the core carries on.
            return UtilityResult(call.call_id, error=str(error))
        return UtilityResult(call.call_id, stats=self.core.make_stats(), value=value)


def _sleep(proc: EngineCoreProc, level: int) -> None:
    proc.core.sleep(int(level))


def _wake_up(proc: EngineCoreProc, *tags: str) -> bool:
    """Whether a part still sleeps afterwards."""
    proc.core.wake_up([str(tag) for tag in tags] if tags else None)
    return bool(proc.core.sleep_level)


def _pause(proc: EngineCoreProc, mode: str, clear_cache: int) -> None:
    """``pagedlm.core.pause``; the outputs of the collected steps and aborted requests go
    out before the answer, so the front end's streams have ended when its call returns."""
    outputs = proc.core.pause(str(mode), bool(clear_cache))
    proc.send_outputs(outputs, send_stats=True)  # workers free them with the next step


def _update_weights_from_disk(proc: EngineCoreProc, model_path: str) -> None:
    proc.core.update_weights(model_path=str(model_path))


def _add_lora(proc: EngineCoreProc, name: str, lora_id: int, path: str) -> bool:
    return proc.core.add_lora(LoRARequest(str(name), int(lora_id), str(path)))


def _list_loras(proc: EngineCoreProc) -> list[int]:
    return sorted(proc.core.list_loras())


def _start_profile(proc: EngineCoreProc, directory: str) -> None:
    proc.profiler.start(directory)


def _stop_profile(proc: EngineCoreProc) -> None:
    proc.profiler.stop()


ADMIN_CALLS: dict[str, Callable[..., bool | list[int] | None]] = {
    "reset_prefix_cache": lambda proc: proc.core.reset_prefix_cache(),
    "pause": _pause,
    "resume": lambda proc: proc.core.resume(),
    "sleep": _sleep,
    "wake_up": _wake_up,
    "update_weights_from_disk": _update_weights_from_disk,
    "add_lora": _add_lora,
    "remove_lora": lambda proc, lora_id: proc.core.remove_lora(int(lora_id)),
    "list_loras": _list_loras,
    "pin_lora": lambda proc, lora_id: proc.core.pin_lora(int(lora_id)),
    "start_profile": _start_profile,
    "stop_profile": _stop_profile,
}
"""Utility calls that change the core's state; ValueError answers the caller's mistake."""


def main(argv: list[str]) -> int:
    input_address, output_address, parent_pid = argv[0], argv[1], int(argv[2])
    # Ctrl-C in a terminal reaches the whole process group; the front end decides when the
    # core stops (it drains requests first), so the core ignores SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Started early (``core_launch``), the core waits here for its configuration.
    payload = sys.stdin.buffer.read()
    if not payload:
        return 0  # the front end gave up before starting the engine
    start = msgspec.json.decode(payload, type=CoreStart)
    os.environ[LOG_LEVEL_ENV] = start.log_level  # for worker processes
    if start.log_config_path is not None:
        os.environ[LOGGING_CONFIG_ENV] = start.log_config_path
    configure_logging(start.log_level, start.log_config_path)  # checked by the front end
    context = zmq.Context()
    output_socket = context.socket(zmq.PUSH)
    output_socket.connect(output_address)
    input_socket = context.socket(zmq.PULL)
    input_socket.connect(input_address)
    encoder = make_encoder()
    status = 0
    try:
        args = start.engine_args
        config, platform = args.create_engine_config(log_defaults=False)
        core = make_engine_core(config, platform)  # one, or one per data-parallel replica
        core.set_grammar_limits(GrammarLimits.of(args))
        scheduler = config.scheduler
        work = InFlightWork(scheduler.max_num_batched_tokens, scheduler.async_scheduling)
        watch = StepWatch(args.engine_iteration_timeout_s)
        freeze_startup_heap("engine core")  # before Ready: the first request never waits on it
        output_socket.send(encoder.encode(Ready(core.num_kv_blocks, core.make_stats())))
        heartbeat = HeartbeatThread(context, output_address, watch)
        heartbeat.start()
        try:
            EngineCoreProc(core, input_socket, output_socket, parent_pid, watch, work).run()
        finally:
            heartbeat.stop()
            core.shutdown()
    except Exception:
        message = traceback.format_exc()
        logger.error("engine core failed:\n%s", message)
        output_socket.send(encoder.encode(CoreFailed(message)))
        status = 1
    finally:
        # Give a final CoreFailed message a moment to leave before the sockets close.
        context.destroy(linger=1000)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
