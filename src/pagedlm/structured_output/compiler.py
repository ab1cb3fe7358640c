"""Grammar compilation off the hot path: a thread pool plus a cache keyed by spec.

``submit`` returns at once with a future; the scheduler keeps the request waiting until
the future is done and keeps running everything else. Equal specs share one future, so a
schema is compiled once however many requests use it, concurrently or later. Failed
compilations are not cached: the next request with that spec tries again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pagedlm.structured_output.backend import GrammarSpec, StructuredOutputBackend

DEFAULT_CACHE_SIZE = 256


class GrammarCompiler:
    """Compiles specs with a lazily built backend, on ``max_workers`` threads.

    ``backend_factory`` builds the backend (tokenizer load, vocabulary tables) in the
    first compile job, so even that cost stays off the engine loop.
    """

    def __init__(
        self,
        backend_factory: Callable[[], StructuredOutputBackend],
        max_workers: int = 1,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        self._backend_factory = backend_factory
        self._backend: StructuredOutputBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="pagedlm-grammar")
        self._cache: OrderedDict[GrammarSpec, Future[Any]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @property
    def backend(self) -> StructuredOutputBackend:
        """The backend, built on first use (blocking; the engine loop only calls this once
        a compile future is done, so the backend exists by then)."""
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._backend_factory()
            return self._backend

    def submit(self, spec: GrammarSpec) -> Future[Any]:
        """A future of the compiled grammar for ``spec`` (shared with equal specs)."""
        with self._lock:
            future = self._cache.get(spec)
            if future is not None and not (future.done() and future.exception() is not None):
                self._cache.move_to_end(spec)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[spec] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return future

    def _compile(self, spec: GrammarSpec) -> Any:
        return self.backend.compile(spec)

    def compile_now(self, spec: GrammarSpec) -> Any:
        """Blocking convenience: submit and wait (tests, benchmarks, warm-up)."""
        return self.submit(spec).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
