"""KV-cache events on ZMQ, read by a subscriber written from vLLM's documented format."""

from __future__ import annotations

import socket
import time
from typing import Any

import msgspec
import pytest
import zmq  # pyzmq: the server extra, part of the test extra

from pagedlm import LLM, SamplingParams
from pagedlm.config import KVEventsConfig
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.kv_cache.hashing import hash_block_tokens

BLOCK_SIZE = 16

# The subscriber's own types, as vLLM's kv_events_subscriber example declares them.
ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _receive(sub, decoder, idle_s: float = 1.0) -> list[tuple[int, KVEventBatch]]:
    batches = []
    deadline = time.monotonic() + idle_s
    while time.monotonic() < deadline:
        if sub.poll(50):
            _topic, seq, payload = sub.recv_multipart()
            batches.append((int.from_bytes(seq, "big"), decoder.decode(payload)))
            deadline = time.monotonic() + idle_s
    return batches


def test_block_events_reach_a_vllm_subscriber(tiny_checkpoint):
    pub_port, replay_port = _free_port(), _free_port()
    config = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://127.0.0.1:{pub_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
    }
    # 8 blocks of 16: the second prompt must evict the first one's cached blocks.
    llm = LLM(
        model=str(tiny_checkpoint("llama")),
        num_kv_blocks=8,
        block_size=BLOCK_SIZE,
        max_model_len=128,
        kv_events_config=config,
        skip_tokenizer_init=True,
    )
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{pub_port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.3)  # a PUB socket drops what it sends before the subscription arrives
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    try:
        first = list(range(1, 3 * BLOCK_SIZE + 6))  # 3 full blocks and 5 tokens
        second = list(range(200, 200 + 5 * BLOCK_SIZE))
        params = SamplingParams(max_tokens=2, temperature=0)
        llm.generate([{"prompt_token_ids": first}], params, use_tqdm=False)
        first_batches = _receive(sub, decoder)
        llm.generate([{"prompt_token_ids": second}], params, use_tqdm=False)
        batches = first_batches + _receive(sub, decoder)

        seqs = [seq for seq, _ in batches]
        assert seqs == list(range(len(seqs))), seqs  # no gaps, from 0
        stored = [e for _, b in first_batches for e in b.events if isinstance(e, BlockStored)]
        assert stored[0].parent_block_hash is None
        assert all(e.block_size == BLOCK_SIZE and e.medium == "GPU" for e in stored)
        hashes = [h for e in stored for h in e.block_hashes]
        tokens = [t for e in stored for t in e.token_ids]
        assert tokens[: 3 * BLOCK_SIZE] == first[: 3 * BLOCK_SIZE]
        parent = None  # the hashes are the chained digests of exactly those tokens
        for index, block_hash in enumerate(hashes):
            block = tokens[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE]
            assert block_hash == hash_block_tokens(parent, block)
            parent = block_hash
        removed = [
            h for _, b in batches for e in b.events if isinstance(e, BlockRemoved)
            for h in e.block_hashes
        ]  # fmt: skip
        assert removed and set(removed) <= set(hashes)

        replay = context.socket(zmq.DEALER)
        replay.connect(f"tcp://127.0.0.1:{replay_port}")
        replay.send_multipart([b"", (1).to_bytes(8, "big")])
        replayed = []
        while replay.poll(2000):
            _, seq, payload = replay.recv_multipart()
            if not payload:
                assert int.from_bytes(seq, "big", signed=True) == -1
                break
            replayed.append((int.from_bytes(seq, "big"), decoder.decode(payload)))
        assert [seq for seq, _ in replayed] == seqs[1:]
        assert [b.events for _, b in replayed] == [b.events for _, b in batches[1:]]
    finally:
        context.destroy(linger=0)
        llm.llm_engine.engine_core.shutdown()


def test_kv_events_config_errors_name_the_fix():
    assert not KVEventsConfig.parse(None).publishes
    assert KVEventsConfig.parse('{"enable_kv_cache_events": true}').publishes
    assert not KVEventsConfig.parse({"enable_kv_cache_events": True, "publisher": "null"}).publishes
    with pytest.raises(ValueError, match="Unknown kv_events_config key"):
        KVEventsConfig.parse({"enable_events": True})
    with pytest.raises(ValueError, match="not valid JSON"):
        KVEventsConfig.parse("{enable")
    with pytest.raises(ValueError, match='"zmq" or "null"'):
        KVEventsConfig.parse({"publisher": "kafka"})
    args = EngineArgs(kv_events_config={"enable_kv_cache_events": True})
    assert isinstance(args.kv_events_config, str)  # travels as JSON to the core process
    assert KVEventsConfig.parse(args.kv_events_config).enable_kv_cache_events
