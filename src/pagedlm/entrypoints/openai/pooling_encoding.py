"""How pooled vectors go on the wire (``/v1/embeddings`` and ``/pooling``), as vLLM sends
them: ``encoding_format`` "float" (JSON numbers), "base64" (one string per result), or
vLLM's "bytes" / "bytes_only" (the results' bytes back to back as the whole
``application/octet-stream`` body; "bytes" adds a ``metadata`` header, JSON with each
result's ``start``/``end`` byte offsets and ``shape``, the usage, id, created and model).

The binary forms hold each value as ``embed_dtype`` ("float32", as OpenAI's SDK decodes
base64, "float16", "bfloat16", or the 8-bit "fp8_e4m3" / "fp8_e5m2") in ``endianness``
byte order ("native": this machine's, as vLLM's default; "big"; "little"). A token-wise
task's result is its rows one after another. "float" ignores both.
"""

from __future__ import annotations

import base64
import json
import sys
from typing import Any, Literal

import torch
from starlette.responses import Response

EncodingFormat = Literal["float", "base64", "bytes", "bytes_only"]
EmbedDType = Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
Endianness = Literal["native", "big", "little"]
BYTES_FORMATS = ("bytes", "bytes_only")

_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
_SAME_WIDTH_INTEGERS = {4: torch.int32, 2: torch.int16, 1: torch.uint8}
"""numpy has no bfloat16 or fp8: the bytes go through an integer of the same width."""


def vector_bytes(vector: Any, embed_dtype: str = "float32", endianness: str = "native") -> bytes:
    """A result's values (a vector, or a token-wise task's rows, row after row) as
    ``embed_dtype`` in ``endianness`` byte order."""
    dtype = _TORCH_DTYPES[embed_dtype]
    values = torch.as_tensor(vector).to(dtype).flatten().contiguous()
    raw = values.view(_SAME_WIDTH_INTEGERS[values.element_size()]).numpy()
    if endianness not in ("native", sys.byteorder):
        raw = raw.byteswap()
    return raw.tobytes()


def encode_vector(
    vector: Any,
    encoding_format: str,
    embed_dtype: str = "float32",
    endianness: str = "native",
) -> list[Any] | str:
    """A result as a JSON response's ``embedding``/``data`` field: float32 numbers (a list
    of rows for a token-wise task), or base64 of ``vector_bytes``."""
    if encoding_format == "base64":
        return base64.b64encode(vector_bytes(vector, embed_dtype, endianness)).decode("ascii")
    return torch.as_tensor(vector).to(torch.float32).tolist()


def bytes_response(
    vectors: list[Any],
    num_prompt_tokens: int,
    header: dict[str, Any],
    encoding_format: str,
    embed_dtype: str,
    endianness: str,
) -> Response:
    """vLLM's binary answer: the results' ``vector_bytes`` as the body; with "bytes" a
    ``metadata`` header holding ``header`` (id, created, model), each result's place in
    the body and the usage."""
    parts = [vector_bytes(vector, embed_dtype, endianness) for vector in vectors]
    headers = None
    if encoding_format == "bytes":
        items, offset = [], 0
        for index, (vector, part) in enumerate(zip(vectors, parts, strict=True)):
            items.append(
                {
                    "index": index,
                    "embed_dtype": embed_dtype,
                    "endianness": endianness,
                    "start": offset,
                    "end": offset + len(part),
                    "shape": list(torch.as_tensor(vector).shape),
                }
            )
            offset += len(part)
        usage = {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens}
        headers = {"metadata": json.dumps({**header, "data": items, "usage": usage})}
    return Response(b"".join(parts), media_type="application/octet-stream", headers=headers)
