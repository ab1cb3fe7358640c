"""Rendering chat templates that came with a request: in worker processes, bounded.

A request's ``chat_template`` is code written by the client. The server refuses it unless
started with ``--trust-request-chat-template``; a trusted one renders here, never in the
server process:

- in a worker process (``python -m pagedlm.entrypoints.openai.template_sandbox``) with
  transformers' sandboxed Jinja environment, at low CPU priority, its address space
  capped at ``WORKER_MEMORY_BYTES`` more than it needs at rest;
- killed after ``RENDER_TIMEOUT_S`` (a fresh worker then starts for the next request);
- at most ``MAX_TEMPLATE_CHARS`` of template and ``MAX_RENDERED_CHARS`` of output.

Requests and answers are JSON lines on the worker's stdin/stdout (nothing pickled). The
event loop only awaits pipe I/O, so a slow template never delays other requests; each
render holds one of ``num_workers`` workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
from typing import Any

logger = logging.getLogger(__name__)

RENDER_TIMEOUT_S = 5.0
STARTUP_TIMEOUT_S = 120.0
"""Importing transformers' template code takes seconds on a loaded machine."""
MAX_TEMPLATE_CHARS = 65536
MAX_RENDERED_CHARS = 16 << 20
WORKER_MEMORY_BYTES = 2 << 30
_LINE_LIMIT = 8 * MAX_RENDERED_CHARS
"""The pipe reader's line limit: a JSON-escaped answer of MAX_RENDERED_CHARS fits."""


class TemplateError(ValueError):
    """The request's template is refused, failed, or ran past a limit (a 400)."""


class _Worker:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    async def call(self, request: dict, timeout_s: float) -> dict:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(request, ensure_ascii=False).encode() + b"\n")
        await self.process.stdin.drain()
        line = await asyncio.wait_for(self.process.stdout.readline(), timeout_s)
        if not line:
            raise TemplateError("The template worker exited while rendering (out of memory?).")
        return json.loads(line)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()


class TemplateSandbox:
    """A pool of ``num_workers`` template worker processes, kept full in the background
    (started by ``start()`` or the first render; a killed worker is replaced at once)."""

    def __init__(
        self,
        special_tokens: dict[str, Any],
        num_workers: int = 2,
        timeout_s: float = RENDER_TIMEOUT_S,
    ) -> None:
        self.special_tokens = special_tokens
        self.timeout_s = timeout_s
        self._num_workers = num_workers
        self._idle: asyncio.Queue[_Worker] | None = None
        self._workers: set[_Worker] = set()
        """Every live worker, idle or rendering (all are killed at shutdown)."""
        self._spawning: set[asyncio.Task] = set()
        self._closed = False

    async def render(
        self,
        template: str,
        conversation: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final_message: bool,
        template_kwargs: dict[str, Any],
    ) -> str:
        """The rendered prompt text; raises ``TemplateError`` (a 400) naming the limit."""
        if len(template) > MAX_TEMPLATE_CHARS:
            raise TemplateError(
                f"The request's chat_template has {len(template)} characters; at most "
                f"{MAX_TEMPLATE_CHARS} are accepted."
            )
        request = {
            "template": template,
            "conversation": conversation,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "kwargs": template_kwargs,
        }
        idle = self.start()
        try:
            worker = await asyncio.wait_for(idle.get(), STARTUP_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise TemplateError(
                "No chat template worker could start; see the server log."
            ) from None
        try:
            answer = await worker.call(request, self.timeout_s)
        except asyncio.TimeoutError:
            self._discard(worker)
            raise TemplateError(
                f"The request's chat_template did not render within {self.timeout_s:g} s; "
                "it was stopped. Simplify the template."
            ) from None
        except BaseException:  # cancelled (client gone) or a broken pipe: start afresh
            self._discard(worker)
            raise
        idle.put_nowait(worker)
        if "error" in answer:
            raise TemplateError(f"The chat template failed on these messages: {answer['error']}")
        return answer["text"]

    def start(self) -> asyncio.Queue[_Worker]:
        """Start workers in the background up to ``num_workers``; the queue of idle ones."""
        if self._idle is None:
            self._idle = asyncio.Queue()
        while not self._closed and len(self._workers) + len(self._spawning) < self._num_workers:
            task = asyncio.ensure_future(self._spawn(self._idle))
            self._spawning.add(task)
            task.add_done_callback(self._spawned)
        return self._idle

    def _spawned(self, task: asyncio.Task) -> None:
        self._spawning.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("A chat template worker failed to start: %s", task.exception())

    async def _spawn(self, idle: asyncio.Queue[_Worker]) -> None:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            __name__,
            json.dumps(self.special_tokens),
            str(os.getpid()),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=_LINE_LIMIT,
        )
        worker = _Worker(process)
        self._workers.add(worker)
        assert process.stdout is not None
        try:
            ready = await asyncio.wait_for(process.stdout.readline(), STARTUP_TIMEOUT_S)
            if not ready:
                raise TemplateError(f"it exited with status {await process.wait()}")
        except BaseException:
            self._discard(worker)
            raise
        idle.put_nowait(worker)

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        self._workers.discard(worker)
        if self._idle is not None:
            self.start()  # a replacement, so the next request does not wait for one

    async def shutdown(self) -> None:
        """Kill every worker and wait for each to exit, so that their pipes close on this
        event loop (not at some later garbage collection, when it is gone)."""
        self._closed = True
        for task in self._spawning:
            task.cancel()
        workers = list(self._workers)
        for worker in workers:
            self._discard(worker)
        for worker in workers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(worker.process.wait(), STARTUP_TIMEOUT_S)


# ----------------------------------------------------------------------------- the worker


def _confine() -> None:
    """Die with the server, lower the CPU priority, cap the address space (Linux; best
    effort elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes
        import signal

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    with contextlib.suppress(OSError, AttributeError):
        os.nice(10)
    try:
        import resource

        with open("/proc/self/statm") as statm:
            size = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        limit = size + WORKER_MEMORY_BYTES
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ImportError, OSError, ValueError):
        logger.warning("cannot cap the template worker's memory", exc_info=True)


def _render(special_tokens: dict[str, Any], request: dict[str, Any]) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    kwargs = dict(request["kwargs"])
    # As tokenizer.apply_chat_template does: keys set to None are left out of messages.
    conversation = [
        {key: value for key, value in message.items() if value is not None}
        for message in request["conversation"]
    ]
    rendered, _ = render_jinja_template(
        conversations=[conversation],
        tools=kwargs.pop("tools", None),
        documents=kwargs.pop("documents", None),
        chat_template=request["template"],
        add_generation_prompt=request["add_generation_prompt"],
        continue_final_message=request["continue_final_message"],
        **{**special_tokens, **kwargs},
    )
    return rendered[0]


def main(argv: list[str]) -> int:
    special_tokens, parent_pid = json.loads(argv[0]), int(argv[1])
    import transformers.utils.chat_template_utils  # noqa: F401  (before the memory cap)

    _confine()
    if os.getppid() != parent_pid:  # the server died before prctl took effect
        return 0
    out = sys.stdout
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        try:
            text = _render(special_tokens, json.loads(line))
            if len(text) > MAX_RENDERED_CHARS:
                raise ValueError(
                    f"it rendered {len(text)} characters, more than the {MAX_RENDERED_CHARS} "
                    "allowed"
                )
            answer = {"text": text}
        except MemoryError:
            answer = {"error": "it needed more memory than a template may use"}
        except Exception as error:  # jinja2 errors, raise_exception(...) in the template
            answer = {"error": str(error) or type(error).__name__}
        out.write(json.dumps(answer, ensure_ascii=False) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
