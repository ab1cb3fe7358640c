"""Starting the engine-core process before its arguments are known.

``pagedlm serve`` spends its first seconds importing torch, FastAPI and the server before
it knows the engine's configuration; the engine-core process then spends as long importing
the same torch. ``CoreLaunch.start()`` runs first, importing only the standard library, so
the core's imports overlap the front end's: the core imports everything its module needs
and then blocks reading its start message (``messages.CoreStart``) on stdin, which the
front end's ``CoreClient`` writes once it has resolved the configuration.

A launch nobody claims (the command line had an error, the port was busy) is
``abandon``-ed: killed, as it has done nothing but import. A core whose front end dies
before sending the start message reads an empty one and exits with status 0 without a
word.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile


class CoreLaunch:
    """The engine-core process and the private directory of its IPC sockets.

    Invariant: the start message is sent (``send_start``) or the launch abandoned, once;
    after either it is ``settled`` and its stdin pipe closed.
    """

    def __init__(self) -> None:
        self.ipc_dir = tempfile.mkdtemp(prefix="pagedlm-")  # mkdtemp: mode 0700
        self.input_address = f"ipc://{self.ipc_dir}/input"
        self.output_address = f"ipc://{self.ipc_dir}/output"
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pagedlm.engine.core_proc",
                self.input_address,
                self.output_address,
                str(os.getpid()),
            ],
            stdin=subprocess.PIPE,
        )

    @classmethod
    def for_command_line(cls, argv: list[str]) -> CoreLaunch | None:
        """A launch for ``pagedlm serve ...`` (not for its ``--help``); None otherwise."""
        if argv[:1] != ["serve"] or any(arg in ("-h", "--help") for arg in argv):
            return None
        return cls()

    def send_start(self, payload: bytes) -> None:
        """Hand the core its start message (``messages.CoreStart``, JSON)."""
        assert self.process.stdin is not None
        with self.process.stdin:
            self.process.stdin.write(payload)

    @property
    def settled(self) -> bool:
        """True once the start message was sent or the launch abandoned."""
        return self.process.stdin is None or self.process.stdin.closed

    def abandon(self) -> None:
        """Stop the core if it never got its start message (it has only imported modules)
        and clean up; a no-op once ``settled``, so callers may call it unconditionally."""
        if self.settled:
            return
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
