"""Errors the front end raises about the engine core itself (not about one request)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine-core process died, was shut down, or stopped answering.

    Every pending and future call on the engine raises this; build a new engine to
    continue.
    """


class EngineStalledError(RuntimeError):
    """The engine-core process is alive but makes no progress: it is stopped (SIGSTOP),
    frozen, or hung inside a step. It may recover (SIGCONT); requests are not failed."""
