"""KV-cache events out of the engine: a ZMQ PUB socket and a replay socket, as vLLM's.

Each ``KVEventBatch`` goes out as one three-frame message: the topic, an 8-byte big-endian
sequence number (0, 1, 2, ... with no gaps), and the batch in msgpack. A subscriber that
sees a gap asks the replay socket (ROUTER; the client is a REQ or DEALER) for everything
from sequence number N (8 bytes, big-endian): it gets ``(seq, payload)`` for each batch
still buffered (the last ``buffer_steps``), then ``(-1, b"")``.

The engine's step thread only encodes a batch and queues it; a background thread owns the
sockets (ZMQ sockets belong to one thread), so a slow network never holds a step.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections import deque

import msgspec

from pagedlm.config import KVEventsConfig
from pagedlm.kv_cache.events import KVCacheEvent, KVEventBatch

logger = logging.getLogger(__name__)

_END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.01


def _endpoint_for_rank(endpoint: str, data_parallel_rank: int) -> str:
    """Replica ``r`` of a data-parallel engine publishes on the configured port + ``r``."""
    if data_parallel_rank == 0:
        return endpoint
    match = re.fullmatch(r"(tcp://.*:)(\d+)", endpoint)
    if match is None:
        return f"{endpoint}-dp{data_parallel_rank}"
    return f"{match.group(1)}{int(match.group(2)) + data_parallel_rank}"


class ZmqEventPublisher:
    """Publishes batches of events; ``shutdown()`` sends what is queued and closes."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self._encoder = msgspec.msgpack.Encoder()
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=config.max_queue_size)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._dropped = 0
        self._thread = threading.Thread(target=self._run, name="pagedlm-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait(timeout=10)
        if self._error is not None:
            raise ValueError(
                f"kv_events_config: cannot bind {config.endpoint!r} or "
                f"{config.replay_endpoint!r}: {self._error}; pick a free port."
            ) from self._error

    def publish(self, events: list[KVCacheEvent]) -> None:
        rank = self.data_parallel_rank or None
        payload = self._encoder.encode(KVEventBatch(time.time(), events, rank))
        try:
            self._queue.put_nowait(payload)
        except queue.Full:
            self._dropped += 1
            if self._dropped == 1 or self._dropped % 1000 == 0:
                logger.warning("KV-cache event queue full: %d batches dropped", self._dropped)

    def shutdown(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        import zmq

        context = zmq.Context()
        try:
            pub = context.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, self.config.hwm)
            pub.setsockopt(zmq.LINGER, 1000)
            pub.bind(_endpoint_for_rank(self.config.endpoint, self.data_parallel_rank))
            replay = None
            if self.config.replay_endpoint:
                replay = context.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(
                    _endpoint_for_rank(self.config.replay_endpoint, self.data_parallel_rank)
                )
        except zmq.ZMQError as error:
            self._error = error
            self._ready.set()
            context.destroy(linger=0)
            return
        self._ready.set()
        topic = self.config.topic.encode()
        buffer: deque[tuple[int, bytes]] = deque(maxlen=self.config.buffer_steps)
        seq = 0
        try:
            while True:
                try:
                    payload = self._queue.get(timeout=_POLL_S)
                except queue.Empty:
                    payload = b""
                if payload is None:
                    return
                if payload:
                    pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                    buffer.append((seq, payload))
                    seq += 1
                while replay is not None and replay.poll(0):
                    self._answer_replay(replay, buffer)
        finally:
            context.destroy(linger=1000)

    @staticmethod
    def _answer_replay(replay, buffer: deque[tuple[int, bytes]]) -> None:
        frames = replay.recv_multipart()
        client, start = frames[0], int.from_bytes(frames[-1], "big")
        envelope = [client, b""] if len(frames) > 2 else [client]
        for seq, payload in buffer:
            if seq >= start:
                replay.send_multipart([*envelope, seq.to_bytes(8, "big"), payload])
        replay.send_multipart([*envelope, _END_OF_REPLAY, b""])
