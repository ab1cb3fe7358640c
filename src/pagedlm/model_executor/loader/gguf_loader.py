"""GGUF files: read the header, map llama metadata to ``ArchConfig``, yield HF-layout weights.

A GGUF file is a little-endian header (magic, version, key/value metadata, tensor infos)
followed by aligned tensor data. We parse the header ourselves with ``struct`` because
``gguf.GGUFReader`` builds a numpy view per array element and takes seconds on a 49k-token
vocabulary; the ``gguf`` package is imported only to dequantize tensor data.

GGUF lists dimensions fastest-varying first, so a ``[out_features, in_features]`` HF matrix is
stored with dims ``(in_features, out_features)``; ``GGUFTensorInfo.shape`` is already reversed
into HF (row-major) order.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedlm.config import ArchConfig

SUPPORTED_ARCHITECTURES = ("llama",)

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_BOOL, _STRING, _ARRAY = 7, 8, 9
_LENGTH = struct.Struct("<Q")
# GGUF value type -> struct format of one scalar (little-endian).
_SCALAR_FORMATS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i",
    6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip

# llama.cpp tensor name -> HF name (without the ".weight"/".bias" suffix).
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in the file. ``shape`` is in HF order, e.g. ``[out, in]``."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    """Absolute byte offset of the tensor data in the file."""


@dataclass(frozen=True)
class GGUFHeader:
    """Everything before the tensor data: metadata (arrays as Python lists) and tensor infos."""

    path: str
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]


class _Cursor:
    """Sequential little-endian reader over the mapped file; a clear error past its end."""

    def __init__(self, buffer: mmap.mmap, path: str) -> None:
        self.buffer = buffer
        self.path = path
        self.pos = 0

    def _truncated(self) -> ValueError:
        return ValueError(f"{self.path} is truncated (header ends early); download it again.")

    def scalar(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        except struct.error:
            raise self._truncated() from None
        self.pos += struct.calcsize(fmt)
        if fmt == "<f":
            # The shortest decimal that round-trips through float32 is the value the writer
            # meant (1e-05, not 9.999999747378752e-06).
            return float(str(np.float32(value)))
        return value

    def strings(self, count: int) -> list[str]:
        # Vocabularies hold ~10^5 strings; a tight loop keeps header parsing near 0.1 s.
        buffer, pos, unpack_length = self.buffer, self.pos, _LENGTH.unpack_from
        strings = []
        try:
            for _ in range(count):
                (length,) = unpack_length(buffer, pos)
                strings.append(buffer[pos + 8 : pos + 8 + length].decode("utf-8"))
                pos += 8 + length
        except struct.error:
            raise self._truncated() from None
        if pos > len(buffer):
            raise self._truncated()
        self.pos = pos
        return strings

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.strings(1)[0]
        if value_type == _ARRAY:
            item_type, count = self.scalar("<I"), self.scalar("<Q")
            if item_type == _STRING:
                return self.strings(count)
            if item_type in _SCALAR_FORMATS and item_type != _BOOL:
                # Numeric arrays (scores, token types) in one numpy call instead of a loop.
                dtype = np.dtype(_SCALAR_FORMATS[item_type])
                if self.pos + dtype.itemsize * count > len(self.buffer):
                    raise self._truncated()
                items = np.frombuffer(self.buffer, dtype, count, self.pos).tolist()
                self.pos += dtype.itemsize * count
                return items
            return [self.value(item_type) for _ in range(count)]
        if value_type not in _SCALAR_FORMATS:
            raise ValueError(f"{self.path}: unknown GGUF value type {value_type}; is it GGUF?")
        return self.scalar(_SCALAR_FORMATS[value_type])


def read_gguf_header(path: str) -> GGUFHeader:
    """Parse the metadata and tensor infos of a GGUF (version 2 or 3) file; reads no tensor data."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        cursor = _Cursor(buffer, path)
        if buffer[:4] != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file (it does not start with b'GGUF').")
        cursor.pos = 4
        version = cursor.scalar("<I")
        if version not in (2, 3):
            hint = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
            raise ValueError(
                f"{path} has GGUF version {version}{hint}; only little-endian versions 2 and 3 "
                "are supported. Re-convert it with a recent llama.cpp convert_hf_to_gguf.py."
            )
        num_tensors, num_metadata = cursor.scalar("<Q"), cursor.scalar("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(num_metadata):
            key = cursor.strings(1)[0]
            metadata[key] = cursor.value(cursor.scalar("<I"))
        infos = []
        for _ in range(num_tensors):
            name = cursor.strings(1)[0]
            dims = [cursor.scalar("<Q") for _ in range(cursor.scalar("<I"))]
            infos.append((name, tuple(reversed(dims)), cursor.scalar("<I"), cursor.scalar("<Q")))
        alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-cursor.pos // alignment) * alignment
    tensors = {
        name: GGUFTensorInfo(name, shape, ggml_type, data_start + offset)
        for name, shape, ggml_type, offset in infos
    }
    return GGUFHeader(path=path, version=version, metadata=metadata, tensors=tensors)


def _check_architecture(header: GGUFHeader) -> str:
    arch = header.metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{header.path} holds a {arch!r} model; the GGUF loader supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}. Pass the original Hugging Face model "
            "directory (config.json + *.safetensors) instead."
        )
    return arch


def _rope_scaling(meta: dict[str, Any], prefix: str, path: str) -> dict[str, Any] | None:
    kind = meta.get(f"{prefix}.rope.scaling.type", "none")
    factor = meta.get(f"{prefix}.rope.scaling.factor")
    if kind == "none" or factor in (None, 0.0, 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        original = meta.get(f"{prefix}.rope.scaling.original_context_length")
        return {
            "rope_type": "yarn",
            "factor": float(factor),
            "original_max_position_embeddings": original,
        }
    raise ValueError(f"{path} uses rope scaling {kind!r}; supported: 'linear', 'yarn'.")


def gguf_arch_config(path: str) -> ArchConfig:
    """The model shape from a llama GGUF's metadata (reads only the header)."""
    header = read_gguf_header(path)
    arch = _check_architecture(header)
    meta = header.metadata

    def require(key: str) -> Any:
        if f"{arch}.{key}" not in meta:
            raise ValueError(
                f"{path} lacks the GGUF metadata key {arch}.{key}; re-convert the model."
            )
        return meta[f"{arch}.{key}"]

    if "rope_freqs.weight" in header.tensors:
        raise ValueError(
            f"{path} uses Llama-3 style rope frequency scaling (rope_freqs.weight), which the GGUF "
            "loader does not support yet; pass the Hugging Face model directory instead."
        )
    hidden = int(require("embedding_length"))
    num_heads = int(require("attention.head_count"))
    num_kv_heads = meta.get(f"{arch}.attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):
        raise ValueError(f"{path} has a per-layer KV head count, which llama models never use.")
    vocab_size = meta.get(f"{arch}.vocab_size")
    if vocab_size is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab_size = len(tokens) if tokens else header.tensors["token_embd.weight"].shape[0]
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eot = meta.get("tokenizer.ggml.eot_token_id")
    # llama.cpp stops on end-of-turn as well as end-of-sequence; keep both when they differ.
    eos_ids: int | list[int] | None = [eos, eot] if None not in (eos, eot) and eos != eot else eos
    return ArchConfig(
        architecture="LlamaForCausalLM",
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        num_hidden_layers=int(require("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(num_kv_heads),
        head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // num_heads)),
        intermediate_size=int(require("feed_forward_length")),
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(meta, arch, path),
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in header.tensors,
        attention_bias="blk.0.attn_q.bias" in header.tensors,
        torch_dtype=None,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=eos_ids,
        raw={key: value for key, value in meta.items() if not isinstance(value, list)},
    )


def hf_tensor_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (llama names)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix in ("weight", "bias"):
        if stem in _GLOBAL_TENSORS:
            return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
        parts = stem.split(".")
        if (
            len(parts) == 3
            and parts[0] == "blk"
            and parts[1].isdigit()
            and parts[2] in _LAYER_TENSORS
        ):
            return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no llama equivalent; is this a llama model?")


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    ``convert_hf_to_gguf`` reorders each head's rows from HF's rotate-half layout
    (``[x_0 .. x_{d/2-1}, y_0 .. y_{d/2-1}]``) into interleaved pairs (``[x_0, y_0, x_1, y_1, ..]``)
    for llama.cpp's rotary kernel. ``weight``: ``[num_heads * head_dim, ...]`` (weight or bias);
    returns the same shape in HF order.
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    if head_dim * num_heads != rows or head_dim % 2:
        raise ValueError(f"Cannot split {rows} rows into {num_heads} heads of even size.")
    paired = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return paired.transpose(1, 2).reshape(weight.shape)


def _dequantize(data: np.memmap, info: GGUFTensorInfo, path: str) -> torch.Tensor:
    import gguf

    qtype = gguf.GGMLQuantizationType(info.ggml_type)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    num_elements = int(np.prod(info.shape))
    nbytes = num_elements // block_size * type_size
    if info.offset + nbytes > data.shape[0]:
        raise ValueError(
            f"{path} is truncated (tensor {info.name} runs past the end); download it again."
        )
    raw = data[info.offset : info.offset + nbytes]
    byte_shape = gguf.quant_shape_to_byte_shape(info.shape, qtype)
    try:
        values = gguf.dequantize(raw.reshape(byte_shape), qtype)
    except NotImplementedError as error:
        raise ValueError(
            f"{path}: tensor {info.name} uses {qtype.name}, which the installed gguf package "
            "cannot dequantize; upgrade gguf or use a file quantized with another type."
        ) from error
    values = values.astype(np.float32, copy=False).reshape(info.shape)
    if not values.flags.writeable:  # F32 data is a view into the read-only memory map
        values = values.copy()
    return torch.from_numpy(values)


def iter_gguf_weights(path: str, arch: ArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` in HF layout, one tensor at a time, in file order.

    Quantized tensors are dequantized; q/k projections are un-permuted with
    ``arch.num_attention_heads`` / ``arch.num_key_value_heads``. ``lm_head.weight`` appears only
    when the file has an ``output.weight`` (otherwise the embeddings are tied).
    """
    header = read_gguf_header(path)
    _check_architecture(header)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    heads = {"attn_q": arch.num_attention_heads, "attn_k": arch.num_key_value_heads}
    for info in header.tensors.values():
        name = hf_tensor_name(info.name)
        tensor = _dequantize(data, info, path)
        kind = info.name.split(".")[-2]
        if info.name.startswith("blk.") and kind in heads:
            tensor = unpermute_rotary_rows(tensor, heads[kind])
        yield name, tensor
