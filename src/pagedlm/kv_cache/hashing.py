"""Content digests of full KV blocks, chained so that a hash names a whole prefix.

The hash of block ``i`` covers the hash of block ``i - 1``, the ``block_size`` token ids of
block ``i`` and the block's extra keys (LoRA adapter id and path, cache salt). Two requests
therefore share a block hash only if they share every token before and inside it, and
the same extra keys. A block overlapping an image's placeholder tokens also carries the
image's content hash: the placeholders are the same token ids for every image, the K/V
are not. A block of a prompt given as embeddings carries the digest of its rows'
bytes for the same reason (its token ids are placeholders), so two prompts that share
their first rows share those blocks. Digests are sha256 over a canonical byte encoding:
stable across processes and runs, unlike Python's ``hash()``, which is salted per process.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedlm.core.request import Request
    from pagedlm.step.multimodal import TensorData

BlockHash = bytes
"""A 32-byte sha256 digest."""

ExtraKey = str | int | bytes
"""Adapter ids (int), cache salts and image identifiers (str), a prompt's embedding rows'
digests (bytes): each type tagged apart, so a salt can never pose as a digest."""

ROOT_HASH: BlockHash = hashlib.sha256(b"pagedlm-prefix-cache-root").digest()
"""Parent of the first block of every request; fixed so hashes are reproducible."""

_TAG_STR = b"s"
_TAG_INT = b"i"
_TAG_BYTES = b"b"


def _encode_extra_key(key: ExtraKey) -> bytes:
    # A type tag and a length prefix keep ("ab",) and ("a", "b") or 1 and "1" distinct.
    if isinstance(key, bool) or not isinstance(key, (str, int, bytes)):
        raise TypeError(f"extra keys must be str, int or bytes, got {type(key).__name__}: {key!r}")
    if isinstance(key, int):
        return _TAG_INT + struct.pack("<q", key)
    if isinstance(key, bytes):
        return _TAG_BYTES + struct.pack("<I", len(key)) + key
    raw = key.encode("utf-8")
    return _TAG_STR + struct.pack("<I", len(raw)) + raw


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: Sequence[ExtraKey] = (),
) -> BlockHash:
    """Digest of one full block, chained from ``parent_hash`` (None: first block)."""
    digest = hashlib.sha256()
    digest.update(ROOT_HASH if parent_hash is None else parent_hash)
    digest.update(struct.pack("<I", len(token_ids)))
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    digest.update(struct.pack("<I", len(extra_keys)))
    for key in extra_keys:
        digest.update(_encode_extra_key(key))
    return digest.digest()


def block_extra_keys(
    request: Request, block_index: int, block_size: int = 0
) -> tuple[ExtraKey, ...]:
    """Extra keys of one block of ``request`` (``block_size`` is needed only when the
    request has images or embeddings).

    The adapter id and the cache salt go into the first block only: the chain carries
    them into every later hash, so repeating them would cost time and change nothing.
    Two adapters therefore never share a block (their K/V differ from the first token).
    The adapter's path goes in beside its id: after ``remove_lora`` the id may name another
    adapter, whose prompts must not hit the old one's blocks (in the prefix cache or the
    offloading connector's host pool); an adapter rewritten in place under the same path
    and id is not told apart.
    Each image's identifier goes into every block its placeholders overlap, with the
    offset of the block's first placeholder inside the image, so the same tokens with
    another image (or the image moved) never hit.
    """
    keys: tuple[ExtraKey, ...] = ()
    if block_index == 0:
        if request.lora_request is not None:
            keys = request.lora_request.adapter_key
        if request.cache_salt is not None:
            keys += (request.cache_salt,)
    if request.mm_features:
        start, end = block_index * block_size, (block_index + 1) * block_size
        for feature in request.mm_features:
            if feature.offset < end and feature.end > start:
                keys += (feature.identifier, max(start - feature.offset, 0))
    if request.prompt_embeds is not None:
        key = embeds_block_key(request.prompt_embeds, block_index, block_size)
        if key is not None:
            keys += (key,)
    return keys


def embeds_block_key(prompt_embeds: TensorData, block_index: int, block_size: int) -> bytes | None:
    """The digest of a block's rows of a prompt given as embeddings (None: the block
    holds none of them). Tagged and typed into the key, so no token id, salt or image
    identifier can collide with it."""
    num_rows = prompt_embeds.shape[0]
    start = block_index * block_size
    if start >= num_rows:
        return None
    row_bytes = len(prompt_embeds.data) // max(num_rows, 1)
    end = min(start + block_size, num_rows)
    rows = memoryview(prompt_embeds.data)[start * row_bytes : end * row_bytes]
    digest = hashlib.sha256(prompt_embeds.dtype.encode("utf-8"))
    digest.update(struct.pack("<II", prompt_embeds.shape[-1], end - start))
    digest.update(rows)
    return digest.digest()


def update_block_hashes(request: Request, block_size: int) -> list[BlockHash]:
    """Extend ``request.block_hashes`` to cover every full block of ``request.all_token_ids``.

    Output tokens count too, so a preempted request finds its own blocks again.
    Returns ``request.block_hashes`` (the same list, updated in place).
    """
    hashes = request.block_hashes
    num_full_blocks = request.num_tokens // block_size
    tokens = request.all_token_ids
    for index in range(len(hashes), num_full_blocks):
        parent = hashes[index - 1] if index > 0 else None
        block_tokens = tokens[index * block_size : (index + 1) * block_size]
        hashes.append(
            hash_block_tokens(parent, block_tokens, block_extra_keys(request, index, block_size))
        )
    return hashes
