"""The engine-core process: ``EngineCore`` in a busy loop behind two ZMQ sockets.

Started by ``CoreClient`` as ``python -m pagedlm.engine.core_proc INPUT OUTPUT PARENT_PID``
with the ``EngineArgs`` as JSON on stdin. The loop:

- idle (no unfinished requests): block on the input socket, waking every second to
  check that the parent is still alive (an orphaned core exits on its own);
- busy: drain every pending input message without blocking, then run one step and send
  its outputs, with the scheduler's stats, as one ``CoreOutputs`` message.

Any exception escaping a step is reported as ``CoreFailed`` and the process exits with
status 1; the front end then fails every waiter.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback

import msgspec
import zmq

from pagedlm.core.engine_core import EngineCore
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.engine.data_parallel import make_engine_core
from pagedlm.engine.messages import (
    AbortRequests,
    AddRequests,
    CoreFailed,
    CoreOutputs,
    Ready,
    RequestRejected,
    Shutdown,
    UtilityCall,
    UtilityResult,
    core_output_to_wire,
    make_encoder,
    make_frontend_decoder,
    request_from_wire,
)

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 1000
"""How often an idle core checks that its parent is alive."""
IDLE_WAIT_MS = 1
"""How long a core with requests but nothing to run waits for input before stepping again."""


class EngineCoreProc:
    """Serves one ``EngineCore`` over a PULL (input) and a PUSH (output) socket."""

    def __init__(
        self, core: EngineCore, input_socket: zmq.Socket, output_socket: zmq.Socket, parent_pid: int
    ) -> None:
        self.core = core
        self.input_socket = input_socket
        self.output_socket = output_socket
        self.parent_pid = parent_pid
        self.encoder = make_encoder()
        self.decoder = make_frontend_decoder()
        self.flush_pending = False
        """Aborted requests whose worker state still needs one (possibly empty) step."""

    def send(self, message: msgspec.Struct) -> None:
        self.output_socket.send(self.encoder.encode(message), copy=False)

    def run(self) -> None:
        """Loop until ``Shutdown`` arrives or the parent goes away."""
        while True:
            busy = self.core.has_unfinished_requests()
            if not self.handle_inputs(block=not busy):
                return
            if self.core.has_unfinished_requests() or self.flush_pending:
                # After an abort the stats change even when the step has no outputs; send
                # them so the front end's metrics never show freed requests as running.
                send_stats = self.flush_pending
                self.flush_pending = False
                outputs = self.core.step()
                if outputs or send_stats:
                    wire = [core_output_to_wire(output) for output in outputs]
                    self.send(CoreOutputs(wire, self.core.make_stats()))
                if not outputs and self.core.has_unfinished_requests():
                    # A step without outputs is a prefill chunk or one where nothing could
                    # run (a request waiting for its grammar): yield briefly to new input
                    # instead of spinning.
                    self.input_socket.poll(IDLE_WAIT_MS)
            if os.getppid() != self.parent_pid:
                logger.warning("engine core: the front-end process is gone; exiting")
                return

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
            self.core.abort_requests(message.request_ids)
            self.flush_pending = True
        elif isinstance(message, UtilityCall):
            self.send(self.answer(message))
        else:
            raise TypeError(f"engine core: unexpected message {type(message).__name__}")

    def add_requests(self, message: AddRequests) -> None:
        added: list[str] = []
        try:
            for wire in message.requests:
                self.core.add_request(request_from_wire(wire))
                added.append(wire.request_id)
        except ValueError as error:
            # All children or none: a rejected request must leave no trace in the core.
            self.core.abort_requests(added)
            self.flush_pending = bool(added)
            self.send(RequestRejected(message.parent_id, str(error)))

    def answer(self, call: UtilityCall) -> UtilityResult:
        if call.method == "ping":
            return UtilityResult(call.call_id)
        if call.method == "get_stats":
            return UtilityResult(call.call_id, stats=self.core.make_stats())
        return UtilityResult(call.call_id, error=f"unknown utility method {call.method!r}")


def main(argv: list[str]) -> int:
    input_address, output_address, parent_pid = argv[0], argv[1], int(argv[2])
    # Ctrl-C in a terminal reaches the whole process group; the front end decides when the
    # core stops (it drains requests first), so the core ignores SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=os.environ.get("PAGEDLM_LOG_LEVEL", "WARNING"))
    context = zmq.Context()
    output_socket = context.socket(zmq.PUSH)
    output_socket.connect(output_address)
    input_socket = context.socket(zmq.PULL)
    input_socket.connect(input_address)
    encoder = make_encoder()
    status = 0
    try:
        args = msgspec.json.decode(sys.stdin.buffer.read(), type=EngineArgs)
        config, platform = args.create_engine_config()
        core = make_engine_core(config, platform)  # one, or one per data-parallel replica
        output_socket.send(encoder.encode(Ready(core.num_kv_blocks, core.make_stats())))
        try:
            EngineCoreProc(core, input_socket, output_socket, parent_pid).run()
        finally:
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
