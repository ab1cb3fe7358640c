"""What names a model's KV in storage that other engines share (``shared_storage.py``):
two engines use the same files only when everything that shapes a block's keys and values
is the same, their weights included.

The weights are named by the files the engine reads, not by their bytes (hashing a
checkpoint of many GiB at start-up is too slow): the checkpoint's resolved absolute path
(a hub snapshot's path holds the repository and its commit) and each weight file's name,
size and modification time (for a hub snapshot, also its blob's name, the sha256 of an LFS
file). So a checkpoint copied elsewhere, or touched, gets a directory of its own; a
checkpoint changed in place without a change of size or modification time is not noticed.
Random (``load_format="dummy"``) weights are named by their seed.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedlm.config import EngineConfig, ModelConfig

FORMAT_VERSION = "1"
"""Of the stored files; part of every model digest."""


def weights_identity(model: ModelConfig) -> dict[str, Any]:
    """The facts naming ``model``'s weights (module doc)."""
    if model.load_format == "dummy":
        return {"dummy_seed": model.seed}
    root = os.path.realpath(model.model)
    if model.is_gguf:
        files = [root]
    else:
        from pagedlm.model_executor.loader.weight_files import checkpoint_files

        files = [str(path) for path in checkpoint_files(model.model, model.load_format).files]
    described = []
    for path in files:
        stat = os.stat(path)  # through a hub snapshot's links, the blob's
        blob = os.path.basename(os.path.realpath(path))
        described.append([os.path.basename(path), blob, stat.st_size, stat.st_mtime_ns])
    return {"path": root, "revision": model.revision, "files": described}


def model_digest(config: EngineConfig) -> str:
    """16 hex digits naming what shapes a block's KV (module doc): the weights, the
    checkpoint's config, dtypes, block size and quantization."""
    model = config.model
    facts = {
        "format": FORMAT_VERSION,
        "arch": model.arch.raw,
        "weights": weights_identity(model),
        "dtype": str(model.dtype),
        "cache_dtype": config.cache.cache_dtype,
        "block_size": config.cache.block_size,
        "quantization": model.quantization,
        "bnb_quant_type": model.bnb_quant_type if model.quantization == "bitsandbytes" else None,
        "model_impl": model.model_impl,
    }
    text = json.dumps(facts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
