"""The front end's handle on the engine-core process: start it, talk to it, stop it.

Sockets (both bound here, connected by the core) live as IPC paths in a private temporary
directory (mode 0700), so no other user can reach them:

- ``input``  PUSH -> core's PULL: ``FrontendMessage`` structs.
- ``output`` PULL <- core's PUSH: ``CoreMessage`` structs, read through a ``zmq.asyncio``
  shadow of the socket by the front end's single output task. The core's heartbeat
  thread connects a second PUSH socket of its own here (``core_heartbeat``).

The core is a fresh interpreter (``subprocess``, ``python -m pagedlm.engine.core_proc``,
started by ``CoreLaunch``, possibly before this client exists), so it never inherits the
parent's threads; the ``EngineArgs`` reach it as JSON on stdin.
Death is the process itself: ``is_alive()`` polls it, and a send to a core that has gone
away raises ``EngineDeadError`` instead of blocking. Whether a live core makes progress
is its heartbeats' business (``engine.health``).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import subprocess
import time

import msgspec
import zmq
import zmq.asyncio

from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.engine.core_launch import CoreLaunch
from pagedlm.engine.exceptions import EngineDeadError
from pagedlm.engine.messages import (
    CoreFailed,
    CoreStart,
    Ready,
    Shutdown,
    make_core_decoder,
    make_encoder,
)
from pagedlm.logging_config import LOG_LEVEL_ENV, LOGGING_CONFIG_ENV

logger = logging.getLogger(__name__)

SEND_RETRY_S = 1.0
"""How long a send waits for a live core to (re)connect before declaring it dead."""


class CoreClient:
    """Owns the engine-core process and the two sockets to it.

    ``start()`` returns at once (the core loads the model in the background);
    ``wait_ready()`` blocks until the core reports ``Ready`` and returns it.
    """

    def __init__(self, args: EngineArgs, launch: CoreLaunch | None = None) -> None:
        """Start the core for ``args``, in ``launch``'s process if one was started early
        (``core_launch``; this client then owns it)."""
        log_level = os.environ.get(LOG_LEVEL_ENV, "WARNING")
        log_config_path = os.environ.get(LOGGING_CONFIG_ENV) or None
        # First: arguments that cannot reach the core fail before anything starts.
        start = msgspec.json.encode(CoreStart(args, log_level, log_config_path), enc_hook=_by_name)
        self._encoder = make_encoder()
        self._decoder = make_core_decoder()
        launch = launch if launch is not None else CoreLaunch()
        self._ipc_dir = launch.ipc_dir
        self._context = zmq.Context()
        self._input = self._context.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(launch.input_address)
        output = self._context.socket(zmq.PULL)
        output.setsockopt(zmq.RCVHWM, 0)
        output.setsockopt(zmq.LINGER, 0)
        output.bind(launch.output_address)
        self._output_sync = output
        self._output: zmq.asyncio.Socket | None = None
        self._closed = False
        self.process = launch.process
        atexit.register(self.shutdown)
        launch.send_start(start)

    def wait_ready(self, timeout_s: float) -> Ready:
        """Block until the core has loaded the model; raises RuntimeError (with the core's
        traceback) if it fails or exits, or does not get ready within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._output_sync.poll(100):
                message = self._decoder.decode(self._output_sync.recv())
                if isinstance(message, Ready):
                    self._output = zmq.asyncio.Socket.from_socket(self._output_sync)
                    return message
                if isinstance(message, CoreFailed):
                    self.shutdown()
                    raise RuntimeError(f"The engine core failed to start:\n{message.message}")
                raise RuntimeError(f"engine core sent {type(message).__name__} before Ready")
            if not self.is_alive():
                status = self.process.returncode
                self.shutdown()
                raise RuntimeError(
                    f"The engine-core process exited with status {status} while starting; "
                    "see its log above."
                )
        self.shutdown()
        raise RuntimeError(
            f"The engine core did not get ready within {timeout_s:.0f} s; check the model "
            "path and the machine's load."
        )

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def exit_description(self) -> str:
        status = self.process.poll()
        if status is None:
            return "the engine-core process is running"
        if status < 0:
            return f"the engine-core process was killed by signal {-status}"
        return f"the engine-core process exited with status {status}"

    def send(self, message: msgspec.Struct) -> None:
        """Queue a message for the core; never blocks for long. Raises EngineDeadError if
        the client is shut down or the core is gone."""
        if self._closed:
            raise EngineDeadError("The engine has been shut down.")
        data = self._encoder.encode(message)
        deadline = time.monotonic() + SEND_RETRY_S
        while True:
            try:
                self._input.send(data, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                # A bound PUSH socket with no connected peer refuses: the core is gone or
                # (briefly) reconnecting.
                if not self.is_alive() or time.monotonic() > deadline:
                    raise EngineDeadError(
                        f"Cannot reach the engine core: {self.exit_description()}."
                    ) from None
                time.sleep(0.01)

    async def recv(self, timeout_ms: int) -> msgspec.Struct | None:
        """The next message from the core, or None if none arrived within ``timeout_ms``."""
        if self._output is None or self._closed:
            raise EngineDeadError("The engine has been shut down.")
        if not await self._output.poll(timeout_ms):
            return None
        frame = await self._output.recv(copy=False)
        return self._decoder.decode(frame.buffer)

    def recv_nowait(self) -> msgspec.Struct | None:
        """The next message from the core if one is already here, else None."""
        if self._output is None or self._closed:
            raise EngineDeadError("The engine has been shut down.")
        try:
            frame = self._output_sync.recv(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        return self._decoder.decode(frame.buffer)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the core (politely, then SIGTERM, then SIGKILL), wait for it, and remove
        the sockets. Idempotent; safe at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        if self.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                self._input.send(self._encoder.encode(Shutdown()), flags=zmq.NOBLOCK)
            self._wait_or(self.process.terminate, timeout_s)
            self._wait_or(self.process.kill, timeout_s)
        self.process.wait()
        for socket in (self._output, self._output_sync, self._input):
            if socket is not None:
                try:
                    socket.close(linger=0)
                except Exception:  # an event loop that is already closed
                    logger.debug("closing a socket failed", exc_info=True)
        self._context.destroy(linger=0)
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def _wait_or(self, escalate, timeout_s: float) -> None:
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            escalate()


def _by_name(obj: object) -> object:
    """Classes in the engine arguments (custom logits processors) go by their names."""
    if isinstance(obj, type):
        from pagedlm.sample.logits_processor import portable_name

        return portable_name(obj)
    raise NotImplementedError(f"cannot send {type(obj).__name__} to the engine core")
