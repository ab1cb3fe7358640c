"""``/start_profile`` and ``/stop_profile`` (and ``LLM.start_profile``/``stop_profile``): a
torch profiler around the engine core's steps.

Runs in the engine-core process (where the uniproc executor's model runs); every activity
torch supports here is recorded (CPU, and CUDA where present). The trace is written to
the server's ``--profiler-dir`` (offline: the directory given, else
``PROFILER_DIR_ENV``) when the profile stops, one file per profile, which
TensorBoard or Perfetto (``chrome://tracing``) open.
"""

from __future__ import annotations

import os
from typing import Any

PROFILER_DIR_ENV = ("PAGEDLM_TORCH_PROFILER_DIR", "VLLM_TORCH_PROFILER_DIR")
"""Where an offline profile's trace goes when no directory is given (vLLM's name too)."""


def profiler_dir_from_env() -> str | None:
    return next((os.environ[name] for name in PROFILER_DIR_ENV if os.environ.get(name)), None)


def profile_directory(directory: str | None) -> str:
    """Where ``start_profile`` (``LLM``'s and ``AsyncLLM``'s) writes its trace: ``directory``,
    else ``PROFILER_DIR_ENV``'s; ValueError naming the fix when neither is given."""
    directory = directory or profiler_dir_from_env()
    if directory is None:
        raise ValueError(
            "start_profile needs a directory for the trace: pass one, or set "
            f"${PROFILER_DIR_ENV[0]}."
        )
    return directory


class CoreProfiler:
    """At most one profile at a time; ``stop`` without ``start`` is an error."""

    def __init__(self) -> None:
        self._profile: Any = None

    def start(self, directory: str) -> None:
        import torch.profiler

        if self._profile is not None:
            raise ValueError("A profile is already running; stop it first (stop_profile).")
        os.makedirs(directory, exist_ok=True)
        profile = torch.profiler.profile(
            activities=sorted(torch.profiler.supported_activities(), key=str),
            record_shapes=True,
            with_stack=False,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(directory, "engine_core"),
        )
        profile.start()
        self._profile = profile

    def stop(self) -> None:
        """Stop the profile and write its trace."""
        if self._profile is None:
            raise ValueError("No profile is running; start one first (start_profile).")
        profile, self._profile = self._profile, None
        profile.stop()  # on_trace_ready writes the trace file
