"""Grammar compilation off the hot path: lanes of threads plus a cache keyed by spec.

``acquire`` returns at once with a future; the scheduler keeps the request waiting until
the future is done and keeps running everything else. Invariants:

- Equal specs share one job (and, once compiled, one cached result), however many
  requests use them; failures are not cached, so the next request tries again.
- A spec of at most ``SMALL_SPEC_CHARS`` characters compiles on the small lane, any other
  on the large lane; each lane runs at most its number of workers at once. A small
  schema therefore never queues behind a large one.
- ``release`` by the last request that wanted a job still in the queue cancels it: it
  never starts. A running compile cannot be interrupted (xgrammar has no way to), so it
  runs to its end and its result is cached; but once nobody wants it, it is written off
  its lane (below), so an aborted or disconnected request never holds up the next spec.
- ``write_off`` (the manager's compile timeout) stops a running compile from counting
  against its lane, so the lane starts its next job; the thread runs on. At most
  ``MAX_COMPILE_THREADS`` compile threads exist at once, written-off ones included;
  further jobs wait.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from pagedlm.structured_output.backend import GrammarSpec, StructuredOutputBackend

DEFAULT_CACHE_SIZE = 256
SMALL_SPEC_CHARS = 4096
"""Specs up to this long (a typical tool or response schema) use the small lane."""
SMALL_LANE_WORKERS = 2
LARGE_LANE_WORKERS = 1
MAX_COMPILE_THREADS = 8


@dataclass(eq=False)
class _Lane:
    workers: int
    queue: deque[_Job] = field(default_factory=deque)
    running: set[_Job] = field(default_factory=set)
    """Started and not written off."""


@dataclass(eq=False)
class _Job:
    spec: GrammarSpec
    lane: _Lane
    future: Future[Any] = field(default_factory=Future)
    users: int = 1
    started: bool = False
    compiling_since: float | None = None
    """When the backend (built by the first job) started compiling this spec."""


class GrammarCompiler:
    """Compiles specs with a lazily built backend (see the module doc for the invariants).

    ``backend_factory`` builds the backend (tokenizer load, vocabulary tables) in the
    first compile job, so even that cost stays off the engine loop.
    """

    def __init__(
        self,
        backend_factory: Callable[[], StructuredOutputBackend],
        small_workers: int = SMALL_LANE_WORKERS,
        large_workers: int = LARGE_LANE_WORKERS,
        cache_size: int = DEFAULT_CACHE_SIZE,
        max_threads: int = MAX_COMPILE_THREADS,
    ) -> None:
        self._backend_factory = backend_factory
        self._backend: StructuredOutputBackend | None = None
        self._backend_lock = threading.Lock()
        self._small = _Lane(small_workers)
        self._large = _Lane(large_workers)
        self._max_threads = max_threads
        self._num_threads = 0
        self._jobs: dict[GrammarSpec, _Job] = {}
        """Queued or running compiles, by spec."""
        self._cache: OrderedDict[GrammarSpec, Future[Any]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._closed = False

    @property
    def backend(self) -> StructuredOutputBackend:
        """The backend, built on first use (blocking; the engine loop only calls this once
        a compile future is done, so the backend exists by then)."""
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._backend_factory()
            return self._backend

    def acquire(self, spec: GrammarSpec) -> Future[Any]:
        """A future of the compiled grammar for ``spec``; pair it with one ``release``."""
        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
                return cached
            job = self._jobs.get(spec)
            if job is not None:
                job.users += 1
                return job.future
            lane = self._small if len(spec.spec) <= SMALL_SPEC_CHARS else self._large
            job = self._jobs[spec] = _Job(spec, lane)
            lane.queue.append(job)
            self._start_jobs()
            return job.future

    def release(self, spec: GrammarSpec, future: Future[Any]) -> None:
        """The user that acquired ``future`` for ``spec`` no longer needs it; a queued job
        nobody needs is cancelled, a running one written off."""
        with self._lock:
            job = self._jobs.get(spec)
            if job is None or job.future is not future:
                return  # compiled (or failed) meanwhile: nothing to give back
            job.users -= 1
            if job.users > 0:
                return
            if not job.started:
                job.lane.queue.remove(job)
                del self._jobs[spec]
                job.future.cancel()
            else:
                # Still in _jobs: a new request for the same spec joins it (and its
                # result is cached), but the lane starts its next job now.
                self._leave_lane(job)

    def running_s(self, spec: GrammarSpec) -> float | None:
        """Seconds the compile of ``spec`` has been running (building the backend does not
        count); None if it is queued or not compiling."""
        with self._lock:
            job = self._jobs.get(spec)
            since = None if job is None else job.compiling_since
            return None if since is None else time.monotonic() - since

    def at_thread_cap(self) -> bool:
        """Every compile thread allowed is running: queued jobs wait for one to end."""
        with self._lock:
            return self._num_threads >= self._max_threads

    def write_off(self, spec: GrammarSpec) -> None:
        """Stop counting the running compile of ``spec`` against its lane."""
        with self._lock:
            job = self._jobs.get(spec)
            if job is not None:
                self._leave_lane(job)

    def _leave_lane(self, job: _Job) -> None:
        """A running ``job`` stops counting against its lane (holding the lock)."""
        if job in job.lane.running:
            job.lane.running.discard(job)
            self._start_jobs()

    def _start_jobs(self) -> None:
        """Start queued jobs while lanes and the thread cap allow (holding the lock)."""
        for lane in (self._small, self._large):
            while (
                lane.queue
                and len(lane.running) < lane.workers
                and self._num_threads < self._max_threads
                and not self._closed
            ):
                job = lane.queue.popleft()
                job.started = True
                job.future.set_running_or_notify_cancel()
                lane.running.add(job)
                self._num_threads += 1
                name = f"pagedlm-grammar-{len(job.spec.spec)}"
                threading.Thread(target=self._run, args=(job,), name=name, daemon=True).start()

    def _run(self, job: _Job) -> None:
        error: BaseException | None = None
        try:
            backend = self.backend
            with self._lock:
                job.compiling_since = time.monotonic()
            result = backend.compile(job.spec)
        except BaseException as exc:  # delivered to the requests, never raised here
            error = exc
        # Bookkeeping first: whoever sees the future done also sees the cache updated.
        with self._lock:
            job.lane.running.discard(job)
            self._num_threads -= 1
            self._jobs.pop(job.spec, None)
            if error is None:
                self._cache[job.spec] = job.future
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            self._start_jobs()
        if error is None:
            job.future.set_result(result)
        else:
            job.future.set_exception(error)

    def compile_now(self, spec: GrammarSpec) -> Any:
        """Blocking convenience: acquire, wait, release (tests, benchmarks, warm-up)."""
        future = self.acquire(spec)
        try:
            return future.result()
        finally:
            self.release(spec, future)

    def shutdown(self) -> None:
        """Cancel every queued job; running compiles are daemon threads and end with the
        process."""
        with self._lock:
            self._closed = True
            for lane in (self._small, self._large):
                for job in lane.queue:
                    self._jobs.pop(job.spec, None)
                    job.future.cancel()
                lane.queue.clear()
